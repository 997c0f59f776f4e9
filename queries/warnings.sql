-- title: Warnings raised inside recorded steps
-- description: Per step and rank, each warning Python showed while the step ran (the same warnings reach the user as without gradstore): category (e.g. UserWarning), message, location ('file:line' the warning names) and count (times shown in the step; under Python's default filter a warning is shown once per location, so a repeated one counts 1 there).
-- param run: run name; NULL for every run
-- param rank: rank; NULL for every rank
-- param step: step number; NULL for every step
SELECT r.name AS run, st.rank, st.step, w.category, w.message, w.location, w.count
FROM step_warnings w
JOIN steps st ON st.id = w.step_id
JOIN runs r ON r.id = st.run_id
WHERE (CAST(:run AS TEXT) IS NULL OR r.name = CAST(:run AS TEXT))
  AND (CAST(:rank AS INTEGER) IS NULL OR st.rank = CAST(:rank AS INTEGER))
  AND (CAST(:step AS INTEGER) IS NULL OR st.step = CAST(:step AS INTEGER))
ORDER BY r.id, st.step, st.rank, w.id;
