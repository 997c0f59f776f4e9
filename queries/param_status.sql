-- title: Why each parameter has (or has no) gradient, per step
-- description: One row per recorded step, rank and parameter name (a tied weight: one row per name, shared_with naming the others; node_param is the name its node is keyed by). status: ok (its AccumulateGrad ran, or with calls = 0 a backward pass wrote its .grad otherwise: DDP's reducer for a parameter this rank did not use; and the gradient is not all zeros), zero (every gradient it received was finite and all zeros), received (it got a gradient whose values were not measured: stats='shape', or stats='params' in a pass that raised), frozen (requires_grad=False), not used (got nothing, no call of its module's forward was seen in the step, module_ran 0, or NULL inside a torch.compile region, and no pass reached it), unreachable (got nothing although its module ran: its AccumulateGrad was not reached from any pass's roots; or reached = 1 and not run: backward(inputs=...), torch.autograd.grad, also over a graph an earlier step's forward built, or a pass that raised before the engine got to it (passes.error); or calls > 0, every call with no gradient: a backward returned None for it), stale (got nothing this step but .grad still holds a tensor from before: an earlier gradient, or the zeros zero_grad(set_to_none=False) wrote; the optimizer applies it either way). module_ran (1 when a module of any of the parameter's names ran: a tied weight's rows share it, since a name's module may be the same module object under another name), reached (NULL: not known: no module tracking; module_ran of a module inside a torch.compile region, whose module calls run in compiled code; stats='params' walks no graph), calls (AccumulateGrad executions; NULL at stats='params', where a backward that changed .grad counts as a gradient, and where a recorder fault in a pass that reached it may have lost its call: not known, the step's error names the fault), has_grad (.grad not None when the step's last backward pass returned, also one that raised). Non-ok rows of a step first.
-- param run: run name; empty (NULL) for every run
-- param rank: rank; empty (NULL) for every rank
-- param step: step number; empty (NULL) for every step
-- param param: a parameter name (any of a tied weight's names); empty (NULL) for all
-- param status: one of ok, zero, received, frozen, not used, unreachable, stale; empty (NULL) for all
SELECT r.name AS run, st.rank, st.step, pn.name AS param, pn.module, ps.name AS status, pn.shared_with,
       n.param AS node_param, x.module_ran, x.reached, x.calls, x.has_grad
FROM param_status x
JOIN steps st ON st.id = x.step_id
JOIN runs r ON r.id = st.run_id
JOIN nodes n ON n.id = x.node_id
JOIN param_names pn ON pn.node_id = x.node_id
JOIN param_statuses ps ON ps.id = x.status
WHERE (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r.name = NULLIF(CAST(:run AS TEXT), ''))
  AND (CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER) IS NULL OR st.rank = CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER))
  AND (CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL OR st.step = CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER))
  AND (NULLIF(CAST(:param AS TEXT), '') IS NULL OR x.node_id IN (
      SELECT pn2.node_id FROM param_names pn2 WHERE pn2.name = NULLIF(CAST(:param AS TEXT), '') AND pn2.run_id = r.id))
  AND (NULLIF(CAST(:status AS TEXT), '') IS NULL OR ps.name = NULLIF(CAST(:status AS TEXT), ''))
ORDER BY r.id, st.step, st.rank, CASE WHEN x.status = 0 THEN 1 ELSE 0 END, n.id, pn.id;
