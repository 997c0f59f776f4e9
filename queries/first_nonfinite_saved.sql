-- title: First non-finite saved tensor
-- description: With record(saved=True): per run and rank, in execution order (step, then seq), the first call whose node had saved a tensor holding NaN or +/-Inf for its backward (a forward value: measured in the node's prehook), one row per such saved tensor (slot = position in gradstore.saved_tensors(node)), with node, module, frame, step and pass. A non-finite forward value is often where a non-finite gradient comes from; first_nonfinite gives the first non-finite gradient.
-- param run: run name; empty (NULL) for every run
-- param rank: rank; empty (NULL) for every rank
-- param step: step number; empty (NULL) for every step
WITH bad AS (
    SELECT st.run_id, st.rank, st.step, c.seq, t.call_id
    FROM tensors t
    JOIN calls c ON c.id = t.call_id
    JOIN steps st ON st.id = t.step_id
    JOIN runs r ON r.id = st.run_id
    WHERE t.nan + t.posinf + t.neginf > 0
      AND t.call_id IS NOT NULL
      AND t.role = 3  -- saved tensors
      AND (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r.name = NULLIF(CAST(:run AS TEXT), ''))
      AND (CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER) IS NULL OR st.rank = CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER))
      AND (CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL OR st.step = CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER))
), ranked AS (
    SELECT call_id, ROW_NUMBER() OVER (PARTITION BY run_id, rank ORDER BY step, seq) AS nth
    FROM bad
)
SELECT r.name AS run, st.rank, st.step, p.pass, c.seq, n.key, n.name, n.module, n.frame,
       ro.name AS role, t.slot, t.numel, t.nan, t.posinf, t.neginf, t.norm, t.min, t.max
FROM ranked
JOIN calls c ON c.id = ranked.call_id
JOIN tensors t ON t.step_id = c.step_id AND t.node_id = c.node_id AND t.call_id = c.id
JOIN passes p ON p.id = c.pass_id
JOIN steps st ON st.id = c.step_id
JOIN runs r ON r.id = st.run_id
JOIN nodes n ON n.id = c.node_id
JOIN roles ro ON ro.id = t.role
WHERE ranked.nth = 1 AND t.nan + t.posinf + t.neginf > 0 AND t.role = 3
ORDER BY r.id, st.rank, t.role, t.slot;
