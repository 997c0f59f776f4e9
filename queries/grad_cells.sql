-- title: Gradient statistics per step and node or module, ready to combine (heatmap cells)
-- description: For each step, rank and node key (by = node) or owning module (by = module): the gradients of one role (grad_output by default), summed so that cells can be combined again exactly (a module and its submodules, micro-batches): tensor_rows (rows), measured (rows with status ok and a norm: a None slot, a skipped tensor and stats='shape' give none), numel, finite (finite elements), sumsq (sum of squared L2 norms over finite elements: the combined norm is its square root), total (sum of the finite elements: mean x finite), min, max, absmax (largest |x|), and the exact nan, posinf, neginf, zeros counts. A cell with measured = 0 was not measured: missing, not zero; norm 0 with nan > 0 is a gradient with no finite element. With by = module, key is NULL.
-- param run: run name; empty (NULL) for every run
-- param by: node (the default, also when empty or NULL) or module
-- param role: grad_output (the default, also when empty or NULL), grad_input, param_grad or saved
-- param rank: rank; empty (NULL) for every rank
-- param module: qualified module name; the module and its submodules; empty (NULL) for all
SELECT r.name AS run, st.rank, st.step,
       CASE WHEN COALESCE(NULLIF(CAST(:by AS TEXT), ''), 'node') = 'module' THEN NULL ELSE n.key END AS key,
       n.module,
       COUNT(*) AS tensor_rows,
       SUM(CASE WHEN t.status = 0 AND t.norm IS NOT NULL THEN 1 ELSE 0 END) AS measured,
       SUM(t.numel) AS numel,
       SUM(t.numel - t.nan - t.posinf - t.neginf) AS finite,
       SUM(t.norm * t.norm) AS sumsq,
       SUM(t.mean * (t.numel - t.nan - t.posinf - t.neginf)) AS total,
       MIN(t.min) AS min,
       MAX(t.max) AS max,
       MAX(CASE WHEN ABS(t.max) >= ABS(t.min) THEN ABS(t.max) ELSE ABS(t.min) END) AS absmax,
       SUM(t.nan) AS nan,
       SUM(t.posinf) AS posinf,
       SUM(t.neginf) AS neginf,
       SUM(t.zeros) AS zeros
FROM tensors t
JOIN steps st ON st.id = t.step_id
JOIN runs r ON r.id = st.run_id
JOIN nodes n ON n.id = t.node_id
WHERE t.role = (SELECT ro.id FROM roles ro WHERE ro.name = COALESCE(NULLIF(CAST(:role AS TEXT), ''), 'grad_output'))
  AND t.node_id IN (  -- start from the run's (and module's) nodes: an index lookup, not a table scan
      SELECT n2.id FROM nodes n2 JOIN runs r2 ON r2.id = n2.run_id
      WHERE (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r2.name = NULLIF(CAST(:run AS TEXT), ''))
        AND (NULLIF(CAST(:module AS TEXT), '') IS NULL OR n2.module = NULLIF(CAST(:module AS TEXT), '')
             OR SUBSTR(n2.module, 1, LENGTH(NULLIF(CAST(:module AS TEXT), '')) + 1) = NULLIF(CAST(:module AS TEXT), '') || '.'))
  AND (CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER) IS NULL OR st.rank = CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER))
  AND t.step_id IN (  -- the run's steps too: with node_id, one seek per (step, node) in the table
      SELECT st2.id FROM steps st2 JOIN runs r2 ON r2.id = st2.run_id
      WHERE (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r2.name = NULLIF(CAST(:run AS TEXT), ''))
        AND (CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER) IS NULL OR st2.rank = CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER)))
GROUP BY r.id, r.name, st.rank, st.step,
         CASE WHEN COALESCE(NULLIF(CAST(:by AS TEXT), ''), 'node') = 'module' THEN NULL ELSE n.key END, n.module
ORDER BY r.id, st.step, st.rank, n.module, key;
