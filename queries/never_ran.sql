-- title: Nodes that never ran in a step
-- description: Per step and rank, the nodes created in the step that no pass ran (a node of a graph an earlier step built, reached and not run, is not listed: see node_births): why = 'not reachable' (created by a module's forward, no pass's roots reach it: a branch whose output does not reach the loss; found from the grad_fn of each tensor a module returned, so nodes inside a module that feed only such an output are not listed), 'reached, not run' (a pass walked to it but the engine did not run it: backward(inputs=...), torch.autograd.grad), 'recomputed, not run' (created by a module's forward re-run inside a backward pass, activation checkpointing without reentrance, whose nodes only rebuild saved tensors: not a missing call). A node whose run is not known (ran NULL: no hooks on it, modules= / params= filters; or a recorder fault in its pass that may have lost its call, named in steps.error) is not listed. module_call, call_module, call_ordinal: the module call it was created in (module_calls.call, its module and ordinal).
-- param run: run name; empty (NULL) for every run
-- param rank: rank; empty (NULL) for every rank
-- param step: step number; empty (NULL) for every step
-- param module: qualified module name of the node; the module and its submodules; empty (NULL) for all
SELECT r.name AS run, st.rank, st.step, n.key, n.name, n.module,
       CASE WHEN sn.recomputed = 1 AND sn.pass IS NULL THEN 'recomputed, not run'
            WHEN sn.pass IS NULL THEN 'not reachable'
            ELSE 'reached, not run' END AS why,
       sn.pass, sn.module_call, mc.module AS call_module, mc.ordinal AS call_ordinal, sn.born_pass, sn.recomputed
FROM step_nodes sn
JOIN steps st ON st.id = sn.step_id
JOIN runs r ON r.id = st.run_id
JOIN nodes n ON n.id = sn.node_id
LEFT JOIN module_calls mc ON mc.step_id = sn.step_id AND mc.call = sn.module_call
WHERE sn.ran = 0
  AND sn.born_step = st.step  -- created in this step (a node of an earlier step's graph is in node_births)
  AND (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r.name = NULLIF(CAST(:run AS TEXT), ''))
  AND (CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER) IS NULL OR st.rank = CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER))
  AND (CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL OR st.step = CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER))
  AND (NULLIF(CAST(:module AS TEXT), '') IS NULL OR n.module = NULLIF(CAST(:module AS TEXT), '')
       OR SUBSTR(n.module, 1, LENGTH(NULLIF(CAST(:module AS TEXT), '')) + 1) = NULLIF(CAST(:module AS TEXT), '') || '.')
ORDER BY r.id, st.step, st.rank, sn.id;
