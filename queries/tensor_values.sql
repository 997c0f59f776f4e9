-- title: Stored elements of small gradients
-- description: With record(values=...): the gradients whose elements were stored: run, rank, step, pass, seq (NULL for param_grad rows), node key, name, module, param, role, slot, occurrence (as in history: 0 for the first row of that key, role and slot in its step, 1, 2, ... for micro-batches), the tensor id, dtype, shape, bytes, and data (the elements: little-endian bytes in C order; Store.tensor decodes them into a torch.Tensor). In order of step, rank, pass and seq.
-- param run: run name; empty (NULL) for every run
-- param rank: rank; empty (NULL) for every rank
-- param step: step number; empty (NULL) for every step
-- param key: node key (e.g. fc/AddmmBackward0#0 or param:fc.weight); empty (NULL) for all
-- param role: grad_output, grad_input or param_grad; empty (NULL) for all
-- param slot: slot; empty (NULL) for all
WITH v AS (
    SELECT t.id, t.step_id, t.node_id, t.role, t.slot, t.pass_id, t.call_id, t.final,
           ROW_NUMBER() OVER (PARTITION BY t.step_id, t.node_id, t.role, t.slot
                              ORDER BY t.final, p.pass, c.seq, t.id) - 1 AS occurrence
    FROM tensors t
    JOIN nodes n ON n.id = t.node_id
    LEFT JOIN passes p ON p.id = t.pass_id
    LEFT JOIN calls c ON c.id = t.call_id
    WHERE t.role IN (0, 1, 2)
      AND t.step_id IN (  -- the matching steps first: the table's own (step_id, id) order, not a scan
          SELECT st2.id FROM steps st2 JOIN runs r2 ON r2.id = st2.run_id
          WHERE (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r2.name = NULLIF(CAST(:run AS TEXT), ''))
            AND (CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER) IS NULL OR st2.rank = CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER))
            AND (CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL OR st2.step = CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER)))
      AND (NULLIF(CAST(:key AS TEXT), '') IS NULL OR n.key = NULLIF(CAST(:key AS TEXT), ''))
)
SELECT r.name AS run, st.rank, st.step, p.pass, c.seq, n.key, n.name, n.module, n.param,
       ro.name AS role, v.slot, v.occurrence, v.id, d.name AS dtype, tv.shape, LENGTH(tv.data) AS bytes, tv.data
FROM v
JOIN tensor_values tv ON tv.id = v.id
JOIN steps st ON st.id = v.step_id
JOIN runs r ON r.id = st.run_id
JOIN nodes n ON n.id = v.node_id
JOIN roles ro ON ro.id = v.role
LEFT JOIN dtypes d ON d.id = tv.dtype
LEFT JOIN passes p ON p.id = v.pass_id
LEFT JOIN calls c ON c.id = v.call_id
WHERE (NULLIF(CAST(:role AS TEXT), '') IS NULL OR ro.name = NULLIF(CAST(:role AS TEXT), ''))
  AND (CAST(NULLIF(CAST(:slot AS TEXT), '') AS INTEGER) IS NULL OR v.slot = CAST(NULLIF(CAST(:slot AS TEXT), '') AS INTEGER))
ORDER BY r.id, st.step, st.rank, v.final, p.pass, CASE WHEN c.seq IS NULL THEN 1 ELSE 0 END, c.seq, n.id, v.role, v.slot;
