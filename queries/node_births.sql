-- title: Nodes a step reached that it did not create in its forward
-- description: Per step and rank, every node one of its passes reached (or a module's recomputation created) that was born elsewhere: in an earlier step (born_step < step: a hidden state that was not detached, a graph retained across steps; born_step NULL: in a step that was not recorded, or before the recording began; or an AccumulateGrad that a node of an earlier step points to, which existed then) or in a backward pass (born_pass: double backward, a reentrant checkpoint's recomputation; recomputed = 1 for nodes of a module forward re-run inside a backward pass). Such a node keeps the key and module it got when it was created (module '?': not known, a node made before the recording began or in a step not recorded; a node of a recorded step that no walk of that step reached gets the module its forward was in then). module_call, call_module, call_ordinal: the module call of born_step it was created in (module_calls.call of that step, its module and ordinal; NULL: outside any module call, not known, or born_step wrote no row: it ran no backward pass). pass: the first pass of the step whose walk reached it (NULL: none did); ran: 0/1 (NULL: it had no hooks).
-- param run: run name; empty (NULL) for every run
-- param rank: rank; empty (NULL) for every rank
-- param step: step number; empty (NULL) for every step
SELECT r.name AS run, st.rank, st.step, sn.pass, n.key, n.name, n.module, sn.born_step, sn.born_pass,
       sn.recomputed, sn.ran, sn.module_call, mc.module AS call_module, mc.ordinal AS call_ordinal
FROM step_nodes sn
JOIN steps st ON st.id = sn.step_id
JOIN runs r ON r.id = st.run_id
JOIN nodes n ON n.id = sn.node_id
LEFT JOIN steps bs ON bs.run_id = st.run_id AND bs.rank = st.rank AND bs.step = sn.born_step
LEFT JOIN module_calls mc ON mc.step_id = bs.id AND mc.call = sn.module_call
WHERE (sn.born_step IS NULL OR sn.born_step <> st.step OR sn.born_pass IS NOT NULL)
  AND (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r.name = NULLIF(CAST(:run AS TEXT), ''))
  AND (CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER) IS NULL OR st.rank = CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER))
  AND (CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL OR st.step = CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER))
ORDER BY r.id, st.step, st.rank, CASE WHEN sn.born_step IS NULL THEN -1 ELSE sn.born_step END, sn.id;
