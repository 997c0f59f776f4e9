-- title: Saved tensors and whether they were modified in place
-- description: With record(saved=True): every tensor a node held for its backward (role saved, slot = position in gradstore.saved_tensors(node)), measured in the node's prehook, with its statistics and its version counter then (version) and when the node saved it (saved_version): modified is 1 when they differ (the tensor was modified in place after it was saved: the statistics are of the tensor as it is now, and a built-in node's backward raises), 0 when they are equal, NULL where the saved version could not be read (note says why: a saved_tensors_hooks pack hook, a custom Function's ctx attribute).
-- param run: run name; empty (NULL) for every run
-- param rank: rank; empty (NULL) for every rank
-- param step: step number; empty (NULL) for every step
-- param module: qualified module name; the module and its submodules; empty (NULL) for all
SELECT r.name AS run, st.rank, st.step, p.pass, c.seq, n.key, n.name, n.module, t.slot,
       su.name AS status, t.reason, d.name AS dtype, t.shape, t.numel,
       t.norm, t.min, t.max, t.mean, t.std, t.nan, t.posinf, t.neginf, t.zeros,
       sv.version, sv.saved_version,
       CASE WHEN sv.saved_version IS NULL THEN NULL WHEN sv.version <> sv.saved_version THEN 1 ELSE 0 END AS modified,
       sv.note
FROM tensors t
JOIN steps st ON st.id = t.step_id
JOIN runs r ON r.id = st.run_id
JOIN nodes n ON n.id = t.node_id
JOIN statuses su ON su.id = t.status
LEFT JOIN dtypes d ON d.id = t.dtype
LEFT JOIN saved_versions sv ON sv.id = t.id
LEFT JOIN passes p ON p.id = t.pass_id
LEFT JOIN calls c ON c.id = t.call_id
WHERE t.role = 3
  AND t.step_id IN (  -- the matching steps first: the table's own (step_id, id) order, not a scan
      SELECT st2.id FROM steps st2 JOIN runs r2 ON r2.id = st2.run_id
      WHERE (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r2.name = NULLIF(CAST(:run AS TEXT), ''))
        AND (CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER) IS NULL OR st2.rank = CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER))
        AND (CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL OR st2.step = CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER)))
  AND (NULLIF(CAST(:module AS TEXT), '') IS NULL OR n.module = NULLIF(CAST(:module AS TEXT), '')
       OR SUBSTR(n.module, 1, LENGTH(NULLIF(CAST(:module AS TEXT), '')) + 1) = NULLIF(CAST(:module AS TEXT), '') || '.')
ORDER BY r.id, st.step, st.rank, p.pass, c.seq, t.slot;
