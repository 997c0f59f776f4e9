-- title: Warnings raised inside recorded steps
-- description: Per step and rank, each warning Python showed while the step ran (the same warnings reach the user as without gradstore): category (e.g. UserWarning), message, location ('file:line' the warning names) and count (times shown in the step; under Python's default filter a warning is shown once per location, so a repeated one counts 1 there).
-- param run: run name; empty (NULL) for every run
-- param rank: rank; empty (NULL) for every rank
-- param step: step number; empty (NULL) for every step
SELECT r.name AS run, st.rank, st.step, w.category, w.message, w.location, w.count
FROM step_warnings w
JOIN steps st ON st.id = w.step_id
JOIN runs r ON r.id = st.run_id
WHERE (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r.name = NULLIF(CAST(:run AS TEXT), ''))
  AND (CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER) IS NULL OR st.rank = CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER))
  AND (CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL OR st.step = CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER))
ORDER BY r.id, st.step, st.rank, w.id;
