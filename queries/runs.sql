-- title: Runs
-- description: Every recorded run with its status, world size, versions, number of recorded steps (all ranks; written ones), its last step written, and unwritten: the steps the writer could not write (a full disk, an I/O error; steps rows of status unwritten, all ranks), which a status of finished does not cover; a run whose writer died with its scope open (killed, out of memory, machine lost) shows status interrupted.
-- param run: run name; empty (NULL) for every run
-- param now: the current time in seconds since the epoch (gradstore binds it; Datasette's canned query q_runs reads it left empty as the current time); a run is interrupted when no claim on one of its ranks stands at that time (heartbeat_at + lease < now) while its status says running or one of its claims lapsed; empty (NULL, as in the sqlite3 shell unbound) shows the stored status (running, even for a dead writer). This SQL sees leases, not pids: a writer killed on this host reads as running here until its lease runs out (60 s after its last heartbeat, by default), where store.runs() and gradstore runs say interrupted at once. (README: how to bind it in sqlite3)
SELECT r.name AS run,
       CASE WHEN CASE WHEN CAST(:now AS TEXT) = '' THEN NULL ELSE CAST(:now AS DOUBLE PRECISION) END IS NOT NULL
                 AND NOT EXISTS (SELECT 1 FROM claims c WHERE c.run_id = r.id
                                 AND c.heartbeat_at + c.lease >= CASE WHEN CAST(:now AS TEXT) = '' THEN NULL ELSE CAST(:now AS DOUBLE PRECISION) END)
                 AND (r.status = 'running' OR EXISTS (SELECT 1 FROM claims c WHERE c.run_id = r.id))
            THEN 'interrupted' ELSE r.status END AS status,
       r.world_size, r.created_at, r.finished_at,
       r.torch_version, r.gradstore_version, r.host,
       (SELECT COUNT(*) FROM steps st WHERE st.run_id = r.id AND st.status <> 'unwritten') AS steps,
       (SELECT MAX(st.step) FROM steps st WHERE st.run_id = r.id AND st.status <> 'unwritten') AS last_step,
       (SELECT MAX(st.ended_at) FROM steps st WHERE st.run_id = r.id AND st.status <> 'unwritten') AS last_step_at,
       (SELECT MAX(c.heartbeat_at) FROM claims c WHERE c.run_id = r.id) AS heartbeat_at,
       (SELECT COUNT(*) FROM steps st WHERE st.run_id = r.id AND st.status = 'unwritten') AS unwritten
FROM runs r
WHERE (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r.name = NULLIF(CAST(:run AS TEXT), ''))
ORDER BY r.id;
