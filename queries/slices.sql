-- title: Slice statistics of gradients
-- description: With record(slices=...): each selected gradient summarised along one dimension (dim, counted from 0): slices (the size of that dimension), zero (slices that are all zero), nonfinite (slices holding NaN or Inf), norm_min / norm_median (the lower median) / norm_max of the L2 norms of the finite slices (NULL when none is finite), zero_first and nonfinite_first (the first 8 indices of such slices, comma-separated; '' for none), reason (why the tensor was not summarised; the rest NULL then), with the tensor row's run, rank, step, pass, seq (NULL for param_grad rows), node, role, slot and shape. In order of step, rank, pass and seq (param_grad rows after their pass's calls).
-- param run: run name; empty (NULL) for every run
-- param rank: rank; empty (NULL) for every rank
-- param step: step number; empty (NULL) for every step
-- param role: grad_output, grad_input or param_grad; empty (NULL) for all
-- param module: qualified module name; the module and its submodules; empty (NULL) for all
-- param key: node key (e.g. transformer.wte/EmbeddingBackward0#0 or param:transformer.wte.weight); empty (NULL) for all
SELECT r.name AS run, st.rank, st.step, p.pass, c.seq, n.key, n.name, n.module, n.param,
       ro.name AS role, t.slot, t.shape, s.dim, s.slices, s.zero, s.nonfinite,
       s.norm_min, s.norm_median, s.norm_max, s.zero_first, s.nonfinite_first, s.reason
FROM tensors t
JOIN tensor_slices s ON s.id = t.id
JOIN steps st ON st.id = t.step_id
JOIN runs r ON r.id = st.run_id
JOIN nodes n ON n.id = t.node_id
JOIN roles ro ON ro.id = t.role
LEFT JOIN passes p ON p.id = t.pass_id
LEFT JOIN calls c ON c.id = t.call_id
WHERE t.step_id IN (  -- the matching steps first: the table's own (step_id, id) order, not a scan
      SELECT st2.id FROM steps st2 JOIN runs r2 ON r2.id = st2.run_id
      WHERE (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r2.name = NULLIF(CAST(:run AS TEXT), ''))
        AND (CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER) IS NULL OR st2.rank = CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER))
        AND (CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL OR st2.step = CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER)))
  AND (NULLIF(CAST(:role AS TEXT), '') IS NULL OR ro.name = NULLIF(CAST(:role AS TEXT), ''))
  AND (NULLIF(CAST(:key AS TEXT), '') IS NULL OR n.key = NULLIF(CAST(:key AS TEXT), ''))
  AND (NULLIF(CAST(:module AS TEXT), '') IS NULL OR n.module = NULLIF(CAST(:module AS TEXT), '')
       OR SUBSTR(n.module, 1, LENGTH(NULLIF(CAST(:module AS TEXT), '')) + 1) = NULLIF(CAST(:module AS TEXT), '') || '.')
ORDER BY r.id, st.step, st.rank, p.pass, CASE WHEN c.seq IS NULL THEN 1 ELSE 0 END, c.seq, n.id, t.role, t.slot;
