-- title: Parameter gradient norms of flight-recorder steps
-- description: The summary a flight recorder (record(keep=N)) writes for every step: each parameter's final gradient norm over its finite elements (NULL where not measured, as at stats='shape') and its count of NaN and infinite elements (nonfinite), with the step's status and level (summary, or the stats level once a dump wrote it in full).
-- param run: run name; empty (NULL) for every run
-- param rank: rank; empty (NULL) for every rank
-- param step: step number; empty (NULL) for every step
-- param param: qualified parameter name; empty (NULL) for all
SELECT r.name AS run, st.rank, st.step, st.status, st.level, n.param, n.module, pn.norm, pn.nonfinite
FROM param_norms pn
JOIN steps st ON st.id = pn.step_id
JOIN runs r ON r.id = st.run_id
JOIN nodes n ON n.id = pn.node_id
WHERE (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r.name = NULLIF(CAST(:run AS TEXT), ''))
  AND (CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER) IS NULL OR st.rank = CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER))
  AND (CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL OR st.step = CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER))
  AND (NULLIF(CAST(:param AS TEXT), '') IS NULL OR n.param = NULLIF(CAST(:param AS TEXT), ''))
ORDER BY r.id, st.step, st.rank, n.id;
