-- title: Calls
-- description: Every node execution, in execution order (seq counts across all passes of a step): start in seconds since its pass began, duration in seconds.
-- param run: run name; NULL for every run
-- param rank: rank; NULL for every rank
-- param step: step number; NULL for every step
-- param module: qualified module name; the module and its submodules; NULL for all
SELECT r.name AS run, st.rank, st.step, p.pass, c.seq, n.key, n.name, n.module, n.param,
       c.start, c.duration
FROM calls c
JOIN passes p ON p.id = c.pass_id
JOIN steps st ON st.id = c.step_id
JOIN runs r ON r.id = st.run_id
JOIN nodes n ON n.id = c.node_id
WHERE (CAST(:run AS TEXT) IS NULL OR r.name = CAST(:run AS TEXT))
  AND (CAST(:rank AS INTEGER) IS NULL OR st.rank = CAST(:rank AS INTEGER))
  AND (CAST(:step AS INTEGER) IS NULL OR st.step = CAST(:step AS INTEGER))
  AND (CAST(:module AS TEXT) IS NULL OR n.module = CAST(:module AS TEXT)
       OR SUBSTR(n.module, 1, LENGTH(CAST(:module AS TEXT)) + 1) = CAST(:module AS TEXT) || '.')
  AND c.pass_id IN (  -- the matching steps' passes first: the calls' (pass_id, seq) index, not a scan
      SELECT p2.id FROM passes p2 JOIN steps st2 ON st2.id = p2.step_id JOIN runs r2 ON r2.id = st2.run_id
      WHERE (CAST(:run AS TEXT) IS NULL OR r2.name = CAST(:run AS TEXT))
        AND (CAST(:rank AS INTEGER) IS NULL OR st2.rank = CAST(:rank AS INTEGER))
        AND (CAST(:step AS INTEGER) IS NULL OR st2.step = CAST(:step AS INTEGER)))
ORDER BY r.id, st.step, st.rank, c.seq;
