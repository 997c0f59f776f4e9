-- title: Gradients not measured
-- description: Per step and rank, the gradient rows (grad_output, grad_input and param_grad), and with record(forward=True) the activation and loss rows, that could not be measured (status skipped: a complex, meta, quantized or nested tensor, a tensor subclass, a layout with no statistics, a recorder fault, or the module calls inside a torch.compile region, which run unseen), grouped by role and reason: run, rank, step, role, reason (as stored on the rows), tensors (rows), params (how many distinct parameters the param_grad rows are of: a pass's row and the step's final row of one parameter count once; 0 for node rows). A step at stats level shape measures no value and skips none: it has no rows here (its status says unmeasured). Empty where every gradient was measured.
-- param run: run name; empty (NULL) for every run
-- param rank: rank; empty (NULL) for every rank
-- param step: step number; empty (NULL) for every step
SELECT r.name AS run, st.rank, st.step, ro.name AS role, x.reason, COUNT(*) AS tensors,
       COUNT(DISTINCT CASE WHEN t.role = 2 THEN t.node_id END) AS params
FROM tensor_data t
JOIN steps st ON st.id = t.step_id
JOIN runs r ON r.id = st.run_id
JOIN roles ro ON ro.id = t.role
LEFT JOIN tensor_notes x ON x.id = t.id
WHERE t.status = 2 AND t.role IN (0, 1, 2, 4, 5)
  AND (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r.name = NULLIF(CAST(:run AS TEXT), ''))
  AND (CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER) IS NULL OR st.rank = CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER))
  AND (CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL OR st.step = CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER))
GROUP BY r.id, r.name, st.rank, st.step, t.role, ro.name, x.reason
ORDER BY r.id, st.step, st.rank, t.role, x.reason;
