-- title: Activations of the forward
-- description: With record(forward=True): the statistics of every module call's output tensors (role activation; a call made while a backward pass ran, activation checkpointing's recomputation, is no forward call and has none: see recomputations), in forward order (seq: the step's counter, shared with the backward calls, so a micro-batch's forward falls between the passes around it): run, rank, step, seq, key (module/forward#k: the k-th call of that module since the last top-level backward pass), name (the module's class), module, slot (position among the call's output tensors), status, dtype, shape, numel, norm, min, max, mean, std, nan, posinf, neginf, zeros.
-- param run: run name; empty (NULL) for every run
-- param rank: rank; empty (NULL) for every rank
-- param step: step number; empty (NULL) for every step
-- param module: qualified module name; the module and its submodules; empty (NULL) for all
SELECT r.name AS run, st.rank, st.step, a.seq, n.key, n.name, n.module, t.slot,
       su.name AS status, t.reason, d.name AS dtype, t.shape, t.numel,
       t.norm, t.min, t.max, t.mean, t.std, t.nan, t.posinf, t.neginf, t.zeros
FROM tensors t
JOIN forward_seqs a ON a.id = t.id
JOIN steps st ON st.id = t.step_id
JOIN runs r ON r.id = st.run_id
JOIN nodes n ON n.id = t.node_id
JOIN statuses su ON su.id = t.status
LEFT JOIN dtypes d ON d.id = t.dtype
WHERE t.role = 4
  AND t.step_id IN (  -- the matching steps first: the table's own (step_id, id) order, not a scan
      SELECT st2.id FROM steps st2 JOIN runs r2 ON r2.id = st2.run_id
      WHERE (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r2.name = NULLIF(CAST(:run AS TEXT), ''))
        AND (CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER) IS NULL OR st2.rank = CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER))
        AND (CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL OR st2.step = CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER)))
  AND (NULLIF(CAST(:module AS TEXT), '') IS NULL OR n.module = NULLIF(CAST(:module AS TEXT), '')
       OR SUBSTR(n.module, 1, LENGTH(NULLIF(CAST(:module AS TEXT), '')) + 1) = NULLIF(CAST(:module AS TEXT), '') || '.')
ORDER BY r.id, st.step, st.rank, a.seq, t.slot;
