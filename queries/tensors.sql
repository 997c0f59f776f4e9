-- title: Tensors
-- description: Statistics of every gradient: grad_output (into a node) and grad_input (out of a node) per call and slot, param_grad (a parameter's .grad when its top-level backward pass returned; final 1: as it stood when the step ended, i.e. as the optimizer saw it, with no pass). norm, min, max, mean, std are over finite elements; nan, posinf, neginf, zeros are exact counts; status none is a None slot, skipped has a reason. A sparse gradient is measured as the dense tensor it represents (implicit zeros included, an uncoalesced tensor's duplicates summed first), with its layout, nnz (stored entries) and coalesced (COO: 1/0); these are NULL for a dense tensor. A DTensor's row describes its local shard (dtype, shape, numel and statistics are this rank's elements) and gives its layout: placements (per mesh dimension, as torch prints them), mesh_shape, mesh_dims, coordinate (this rank's on the mesh), global_shape and global_offset (the global index of the shard's first element); NULL for a plain tensor.
-- param run: run name; empty (NULL) for every run
-- param rank: rank; empty (NULL) for every rank
-- param step: step number; empty (NULL) for every step
-- param role: grad_output, grad_input, param_grad or saved; empty (NULL) for all
-- param module: qualified module name; the module and its submodules; empty (NULL) for all
SELECT r.name AS run, st.rank, st.step, p.pass, c.seq, n.key, n.name, n.module, n.param,
       ro.name AS role, t.slot, su.name AS status, t.reason, d.name AS dtype, t.shape, t.numel,
       t.norm, t.min, t.max, t.mean, t.std, t.nan, t.posinf, t.neginf, t.zeros, t.layout, t.nnz, t.coalesced,
       dt.placements, dt.mesh_shape, dt.mesh_dims, dt.coordinate, dt.global_shape, dt.global_offset, t.final
FROM tensors t
JOIN steps st ON st.id = t.step_id
JOIN runs r ON r.id = st.run_id
JOIN nodes n ON n.id = t.node_id
JOIN roles ro ON ro.id = t.role
JOIN statuses su ON su.id = t.status
LEFT JOIN dtypes d ON d.id = t.dtype
LEFT JOIN passes p ON p.id = t.pass_id
LEFT JOIN calls c ON c.id = t.call_id
LEFT JOIN dtensors dt ON dt.id = t.id
WHERE (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r.name = NULLIF(CAST(:run AS TEXT), ''))
  AND (CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER) IS NULL OR st.rank = CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER))
  AND (CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL OR st.step = CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER))
  AND t.step_id IN (  -- the matching steps first: the table's own (step_id, id) order, not a scan
      SELECT st2.id FROM steps st2 JOIN runs r2 ON r2.id = st2.run_id
      WHERE (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r2.name = NULLIF(CAST(:run AS TEXT), ''))
        AND (CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER) IS NULL OR st2.rank = CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER))
        AND (CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL OR st2.step = CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER)))
  AND (NULLIF(CAST(:role AS TEXT), '') IS NULL OR ro.name = NULLIF(CAST(:role AS TEXT), ''))
  AND (NULLIF(CAST(:module AS TEXT), '') IS NULL OR n.module = NULLIF(CAST(:module AS TEXT), '')
       OR SUBSTR(n.module, 1, LENGTH(NULLIF(CAST(:module AS TEXT), '')) + 1) = NULLIF(CAST(:module AS TEXT), '') || '.')
ORDER BY r.id, st.step, st.rank, t.final, CASE WHEN p.pass IS NULL THEN 1 ELSE 0 END, p.pass, CASE WHEN c.seq IS NULL THEN 1 ELSE 0 END, c.seq, n.id, t.role, t.slot, t.id;
