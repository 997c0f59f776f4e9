-- title: Losses: the roots of every top-level backward pass
-- description: With record(forward=True): each root tensor of each top-level backward pass (role loss: the loss; a pass nested in another, a reentrant checkpoint's, has none: a file written before gradstore knew this holds loss rows of such a pass's root, left out here), measured as the pass started: run, rank, step, pass, seq (its place in the step's counter, shared with the forward's module calls and the backward calls), key (the root's node), name, module, slot (position among the tensors given to backward), value (the root's value when it has one element and it is finite; NULL otherwise), status, dtype, shape, numel and its statistics (norm, min, max, mean, std over the finite elements; exact nan, posinf, neginf, zeros counts: a NaN loss has nan = 1). In order of step, rank and pass.
-- param run: run name; empty (NULL) for every run
-- param rank: rank; empty (NULL) for every rank
-- param step: step number; empty (NULL) for every step
SELECT r.name AS run, st.rank, st.step, p.pass, a.seq, n.key, n.name, n.module, t.slot,
       CASE WHEN t.numel = 1 AND t.nan + t.posinf + t.neginf = 0 THEN t.max END AS value,
       su.name AS status, d.name AS dtype, t.shape, t.numel,
       t.norm, t.min, t.max, t.mean, t.std, t.nan, t.posinf, t.neginf, t.zeros
FROM tensor_data td
JOIN tensors t ON t.step_id = td.step_id AND t.node_id = td.node_id AND t.id = td.id
JOIN forward_seqs a ON a.id = t.id
JOIN steps st ON st.id = t.step_id
JOIN runs r ON r.id = st.run_id
JOIN nodes n ON n.id = t.node_id
JOIN statuses su ON su.id = t.status
LEFT JOIN dtypes d ON d.id = t.dtype
LEFT JOIN passes p ON p.id = t.pass_id
WHERE td.role = 5  -- the loss rows' partial index (ix_tensor_data_loss)
  AND p.parent_pass IS NULL  -- a top-level pass's
  AND td.step_id IN (
      SELECT st2.id FROM steps st2 JOIN runs r2 ON r2.id = st2.run_id
      WHERE (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r2.name = NULLIF(CAST(:run AS TEXT), ''))
        AND (CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER) IS NULL OR st2.rank = CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER))
        AND (CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL OR st2.step = CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER)))
ORDER BY r.id, st.step, st.rank, p.pass, t.slot;
