-- title: Step values
-- description: The scalars stored with each step (rec.log, gradstore.log, the trainer callbacks' loss, learning rate and grad norm, and gradstore's own: grad_scaler.scale, grad_scaler.skipped, clip_grad_norm), one row per step, rank and name. value NULL means NaN (SQLite stores a NaN as NULL).
-- param run: run name; empty (NULL) for every run
-- param rank: rank; empty (NULL) for every rank
-- param step: step number; empty (NULL) for every step
-- param value_name: the value's name; empty (NULL) for all
SELECT r.name AS run, st.rank, st.step, v.name, v.value
FROM step_values v
JOIN steps st ON st.id = v.step_id
JOIN runs r ON r.id = st.run_id
WHERE (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r.name = NULLIF(CAST(:run AS TEXT), ''))
  AND (CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER) IS NULL OR st.rank = CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER))
  AND (CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL OR st.step = CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER))
  AND (NULLIF(CAST(:value_name AS TEXT), '') IS NULL OR v.name = NULLIF(CAST(:value_name AS TEXT), ''))
ORDER BY r.id, st.step, st.rank, v.name;
