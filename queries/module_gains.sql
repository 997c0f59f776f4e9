-- title: Gradient gain of every module call, in backward order
-- description: One row per module forward call per step and rank (ordinal: the module's 0th, 1st, ... call in the step), in backward order (first_seq: the seq of the first call of one of its nodes; calls whose nodes never ran last). in_norm: sqrt(sum of squares) of the gradients flowing into the call w.r.t. its outputs: the grad_outputs of its nodes (created inside it or its submodules) at each slot fed by an edge from a node outside it, and the seed of a pass's root inside it; out_norm: the same of the gradients flowing out w.r.t. its inputs: the grad_inputs its nodes send along edges to nodes outside it, except to its own parameters' AccumulateGrad nodes; both summed over the step's passes. ratio = out_norm / in_norm: above 1 the call amplifies the gradient, below 1 it shrinks it; NULL where a boundary tensor was not measured (in_unmeasured, out_unmeasured: no hooks there, stats='shape'), where one held NaN or Inf (nonfinite), or where nothing flowed in. nodes: its nodes that were found; ran: how many of them ran (NULL: not known). during_pass and recomputes: a call re-run inside a backward pass (activation checkpointing) and the call number of the forward call it recomputes. Unlike grad_norms(by='module'), no parameter gradient is in these figures. At stats='params', which walks no graph, in_tensors, out_tensors, in_unmeasured, out_unmeasured, nonfinite and nodes are NULL (not known), as are in_norm, out_norm and ratio.
-- param run: run name; empty (NULL) for every run
-- param rank: rank; empty (NULL) for every rank
-- param step: step number; empty (NULL) for every step
-- param module: qualified module name; the module and its submodules; empty (NULL) for all
SELECT r.name AS run, st.rank, st.step, mc.call, mc.module, mc.ordinal, mc.first_seq, mc.in_norm, mc.out_norm,
       CASE WHEN mc.in_unmeasured = 0 AND mc.out_unmeasured = 0 AND mc.nonfinite = 0 AND mc.in_norm > 0
            THEN mc.out_norm / mc.in_norm END AS ratio,
       -- stats='params' walks no graph: which gradients crossed the call, and how many nodes it made, are not known
       CASE WHEN st.level = 'params' THEN NULL ELSE mc.in_tensors END AS in_tensors,
       CASE WHEN st.level = 'params' THEN NULL ELSE mc.out_tensors END AS out_tensors,
       CASE WHEN st.level = 'params' THEN NULL ELSE mc.in_unmeasured END AS in_unmeasured,
       CASE WHEN st.level = 'params' THEN NULL ELSE mc.out_unmeasured END AS out_unmeasured,
       CASE WHEN st.level = 'params' THEN NULL ELSE mc.nonfinite END AS nonfinite,
       CASE WHEN st.level = 'params' THEN NULL ELSE mc.nodes END AS nodes, mc.ran,
       mc.during_pass, mc.recomputes
FROM module_calls mc
JOIN steps st ON st.id = mc.step_id
JOIN runs r ON r.id = st.run_id
WHERE (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r.name = NULLIF(CAST(:run AS TEXT), ''))
  AND (CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER) IS NULL OR st.rank = CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER))
  AND (CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL OR st.step = CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER))
  AND (NULLIF(CAST(:module AS TEXT), '') IS NULL OR mc.module = NULLIF(CAST(:module AS TEXT), '')
       OR SUBSTR(mc.module, 1, LENGTH(NULLIF(CAST(:module AS TEXT), '')) + 1) = NULLIF(CAST(:module AS TEXT), '') || '.')
ORDER BY r.id, st.step, st.rank, CASE WHEN mc.first_seq IS NULL THEN 1 ELSE 0 END, mc.first_seq, mc.call;
