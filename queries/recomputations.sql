-- title: Module forwards re-run inside a backward pass (activation checkpointing)
-- description: Per step and rank, every module call made while a backward pass ran: during_pass, during_seq and running (the key of the node whose call was executing: CheckpointFunctionBackward for a reentrant checkpoint, the node unpacking its saved tensors otherwise), recomputes (the call number of the forward call it re-runs, in module_calls; NULL where none was found) and original_ordinal (that call's ordinal), nodes (found) and ran (how many of them ran: a reentrant checkpoint runs its recomputed nodes in a nested pass; a non-reentrant one only rebuilds saved tensors, so 0), in_norm and out_norm as module_gains.
-- param run: run name; empty (NULL) for every run
-- param rank: rank; empty (NULL) for every rank
-- param step: step number; empty (NULL) for every step
SELECT r.name AS run, st.rank, st.step, mc.call, mc.module, mc.ordinal, mc.during_pass, mc.during_seq,
       (SELECT n.key FROM passes p
        JOIN calls c ON c.id BETWEEN p.first_call AND p.last_call AND +c.pass_id = +p.id
        JOIN nodes n ON n.id = c.node_id
        WHERE p.step_id = st.id AND c.seq = mc.during_seq) AS running,
       mc.recomputes, o.ordinal AS original_ordinal, mc.nodes, mc.ran, mc.in_norm, mc.out_norm
FROM module_calls mc
JOIN steps st ON st.id = mc.step_id
JOIN runs r ON r.id = st.run_id
LEFT JOIN module_calls o ON o.step_id = mc.step_id AND o.call = mc.recomputes
WHERE mc.during_pass IS NOT NULL
  AND (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r.name = NULLIF(CAST(:run AS TEXT), ''))
  AND (CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER) IS NULL OR st.rank = CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER))
  AND (CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL OR st.step = CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER))
ORDER BY r.id, st.step, st.rank, mc.call;
