-- title: Nodes
-- description: Every autograd node seen in a run: its stable key, name, kind, owning module ('' outside any module), parameter (AccumulateGrad of a parameter), the user-code frame that created it (record(frames=True)), for a node made inside a torch.compile'd module's call (its CompiledFunctionBackward, a backend's per-op node, the forward's region#k row) the modules inside the region (comma-separated), and the step it was first seen in.
-- param run: run name; empty (NULL) for every run
-- param module: qualified module name; the module and its submodules; empty (NULL) for all
SELECT r.name AS run, n.key, n.name, k.name AS kind, n.module, n.param, n.frame, n.region, n.first_step
FROM nodes n
JOIN runs r ON r.id = n.run_id
JOIN kinds k ON k.id = n.kind
WHERE (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r.name = NULLIF(CAST(:run AS TEXT), ''))
  AND (NULLIF(CAST(:module AS TEXT), '') IS NULL OR n.module = NULLIF(CAST(:module AS TEXT), '')
       OR SUBSTR(n.module, 1, LENGTH(NULLIF(CAST(:module AS TEXT), '')) + 1) = NULLIF(CAST(:module AS TEXT), '') || '.')
ORDER BY r.id, n.id;
