-- title: Runs
-- description: Every recorded run with its status, world size, versions and number of recorded steps (all ranks).
-- param run: run name; empty (NULL) for every run
SELECT r.name AS run, r.status, r.world_size, r.created_at, r.finished_at,
       r.torch_version, r.gradstore_version, r.host,
       (SELECT COUNT(*) FROM steps st WHERE st.run_id = r.id) AS steps
FROM runs r
WHERE (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r.name = NULLIF(CAST(:run AS TEXT), ''))
ORDER BY r.id;
