-- title: History of a node, module or parameter over steps
-- description: The gradient statistics of one node (key), one module and its submodules (module), or one parameter (param: its AccumulateGrad node's grad_outputs and its param_grad rows) in every recorded step and rank, in order of step, rank, pass and seq (param_grad rows after their pass's calls; final = 1 marks the param_grad row taken when the step ended, as the optimizer saw the gradient, last in its step). occurrence counts earlier rows of the same key, role and slot in the same step (0 for the first call; micro-batches and retained-graph passes give 1, 2, ...). norm, min, max, mean, std are over finite elements; nan, posinf, neginf, zeros are exact counts; checksum is set for param_grad rows when recorded (NULL = unknown); layout, nnz and coalesced describe a sparse gradient (NULL when dense). A DTensor gradient's row is this rank's local piece (its statistics are the piece's, not the whole gradient's): placements and global_shape give its layout (NULL for a plain tensor); global_grads combines a parameter's pieces. reason says why a skipped row (status skipped) was not measured.
-- param run: run name; empty (NULL) for every run
-- param key: node key (e.g. fc/AddmmBackward0#0 or param:fc.weight); empty (NULL) for all
-- param module: qualified module name; the module and its submodules; empty (NULL) for all
-- param param: qualified parameter name (any of a tied weight's names); empty (NULL) for all
-- param role: grad_output, grad_input or param_grad; empty (NULL) for all
-- param rank: rank; empty (NULL) for every rank
SELECT r.name AS run, st.rank, st.step, p.pass, c.seq, n.key, n.name, n.module, n.param,
       ro.name AS role, t.slot,
       ROW_NUMBER() OVER (PARTITION BY t.step_id, t.node_id, t.role, t.slot
                          ORDER BY t.final, p.pass, c.seq, t.id) - 1 AS occurrence,
       su.name AS status, d.name AS dtype, t.shape, t.numel,
       t.norm, t.min, t.max, t.mean, t.std, t.nan, t.posinf, t.neginf, t.zeros, t.checksum,
       t.layout, t.nnz, t.coalesced, t.final, t.reason, dt.placements, dt.global_shape
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
WHERE t.node_id IN (  -- the run's matching nodes first: an index lookup, not a table scan
      SELECT n2.id FROM nodes n2 JOIN runs r2 ON r2.id = n2.run_id
      WHERE (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r2.name = NULLIF(CAST(:run AS TEXT), ''))
        AND (NULLIF(CAST(:key AS TEXT), '') IS NULL OR n2.key = NULLIF(CAST(:key AS TEXT), ''))
        AND (NULLIF(CAST(:param AS TEXT), '') IS NULL OR n2.param = NULLIF(CAST(:param AS TEXT), '')
             OR n2.id IN (SELECT pn.node_id FROM param_names pn WHERE pn.name = NULLIF(CAST(:param AS TEXT), '')))
        AND (NULLIF(CAST(:module AS TEXT), '') IS NULL OR n2.module = NULLIF(CAST(:module AS TEXT), '')
             OR SUBSTR(n2.module, 1, LENGTH(NULLIF(CAST(:module AS TEXT), '')) + 1) = NULLIF(CAST(:module AS TEXT), '') || '.'))
  AND (NULLIF(CAST(:role AS TEXT), '') IS NULL OR ro.name = NULLIF(CAST(:role AS TEXT), ''))
  AND (CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER) IS NULL OR st.rank = CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER))
  AND t.step_id IN (  -- the run's steps too: with node_id, one seek per (step, node) in the table
      SELECT st2.id FROM steps st2 JOIN runs r2 ON r2.id = st2.run_id
      WHERE (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r2.name = NULLIF(CAST(:run AS TEXT), ''))
        AND (CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER) IS NULL OR st2.rank = CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER)))
ORDER BY r.id, st.step, st.rank, t.final, CASE WHEN p.pass IS NULL THEN 1 ELSE 0 END, p.pass, CASE WHEN c.seq IS NULL THEN 1 ELSE 0 END, c.seq, n.id, t.role, t.slot, t.id;
