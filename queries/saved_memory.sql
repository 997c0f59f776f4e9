-- title: Saved-tensor memory per module
-- description: With record(saved=True): per step and owning module, how many tensors its nodes held for their backward (role saved) and how much memory that is in bytes (numel x element size; a tensor saved by several nodes is counted once per node), with the largest single saved tensor.
-- param run: run name; empty (NULL) for every run
-- param rank: rank; empty (NULL) for every rank
-- param step: step number; empty (NULL) for every step
SELECT r.name AS run, st.rank, st.step, n.module,
       COUNT(*) AS saved_tensors,
       SUM(t.numel * CASE d.name
             WHEN 'float64' THEN 8 WHEN 'int64' THEN 8 WHEN 'complex64' THEN 8 WHEN 'uint64' THEN 8
             WHEN 'complex128' THEN 16
             WHEN 'float32' THEN 4 WHEN 'int32' THEN 4 WHEN 'uint32' THEN 4
             WHEN 'float16' THEN 2 WHEN 'bfloat16' THEN 2 WHEN 'int16' THEN 2 WHEN 'uint16' THEN 2
             ELSE 1 END) AS bytes,
       MAX(t.numel) AS largest_numel
FROM tensors t
JOIN steps st ON st.id = t.step_id
JOIN runs r ON r.id = st.run_id
JOIN nodes n ON n.id = t.node_id
LEFT JOIN dtypes d ON d.id = t.dtype
WHERE t.role = 3 AND t.status <> 1
  AND (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r.name = NULLIF(CAST(:run AS TEXT), ''))
  AND (CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER) IS NULL OR st.rank = CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER))
  AND (CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL OR st.step = CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER))
  AND t.step_id IN (  -- the matching steps first: the table's own (step_id, id) order, not a scan
      SELECT st2.id FROM steps st2 JOIN runs r2 ON r2.id = st2.run_id
      WHERE (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r2.name = NULLIF(CAST(:run AS TEXT), ''))
        AND (CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER) IS NULL OR st2.rank = CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER))
        AND (CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL OR st2.step = CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER)))
GROUP BY r.id, r.name, st.rank, st.step, n.module
ORDER BY r.id, st.step, st.rank, bytes DESC;
