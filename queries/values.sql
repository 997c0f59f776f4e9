-- title: Step values
-- description: The scalars stored with each step (rec.log, gradstore.log, the trainer callbacks' loss, learning rate and grad norm, and gradstore's own: grad_scaler.scale, grad_scaler.skipped, clip_grad_norm), one row per step, rank and name. value NULL means NaN (SQLite stores a NaN as NULL).
-- param run: run name; NULL for every run
-- param rank: rank; NULL for every rank
-- param step: step number; NULL for every step
-- param value_name: the value's name; NULL for all
SELECT r.name AS run, st.rank, st.step, v.name, v.value
FROM step_values v
JOIN steps st ON st.id = v.step_id
JOIN runs r ON r.id = st.run_id
WHERE (CAST(:run AS TEXT) IS NULL OR r.name = CAST(:run AS TEXT))
  AND (CAST(:rank AS INTEGER) IS NULL OR st.rank = CAST(:rank AS INTEGER))
  AND (CAST(:step AS INTEGER) IS NULL OR st.step = CAST(:step AS INTEGER))
  AND (CAST(:value_name AS TEXT) IS NULL OR v.name = CAST(:value_name AS TEXT))
ORDER BY r.id, st.step, st.rank, v.name;
