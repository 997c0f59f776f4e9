-- title: Gradient norms per node or per module, per step
-- description: For each step and node key (by = node) or owning module (by = module): the L2 norm of all grad_outputs flowing into it and of all grad_inputs flowing out of it, taken over finite elements and combined over slots, calls and passes as sqrt(sum of squared norms) (a None slot, no gradient, adds 0); NULL where one of those gradients was not measured (stats='shape', a skipped tensor), never 0, and where there is none (an AccumulateGrad has no grad_inputs); calls counts executions; nonfinite counts NaN and +/-Inf elements, NULL where one was not measured. With by = module, key is NULL.
-- param run: run name; empty (NULL) for every run
-- param by: node (the default, also when empty or NULL) or module
-- param rank: rank; empty (NULL) for every rank
-- param step: step number; empty (NULL) for every step
-- param module: qualified module name; the module and its submodules; empty (NULL) for all
SELECT r.name AS run, st.rank, st.step,
       CASE WHEN COALESCE(NULLIF(CAST(:by AS TEXT), ''), 'node') = 'module' THEN NULL ELSE n.key END AS key,
       n.module,
       CASE WHEN SUM(CASE WHEN t.role = 0 AND (t.status = 2 OR (t.status = 0 AND t.norm IS NULL)) THEN 1 ELSE 0 END) > 0
                 OR SUM(CASE WHEN t.role = 0 THEN 1 ELSE 0 END) = 0
            THEN NULL ELSE SQRT(SUM(CASE WHEN t.role = 0 THEN t.norm * t.norm ELSE 0 END)) END AS grad_output_norm,
       CASE WHEN SUM(CASE WHEN t.role = 1 AND (t.status = 2 OR (t.status = 0 AND t.norm IS NULL)) THEN 1 ELSE 0 END) > 0
                 OR SUM(CASE WHEN t.role = 1 THEN 1 ELSE 0 END) = 0  -- none: an AccumulateGrad has no grad_inputs
            THEN NULL ELSE SQRT(SUM(CASE WHEN t.role = 1 THEN t.norm * t.norm ELSE 0 END)) END AS grad_input_norm,
       COUNT(DISTINCT t.call_id) AS calls,
       CASE WHEN SUM(CASE WHEN t.status = 2 OR (t.status = 0 AND t.nan IS NULL) THEN 1 ELSE 0 END) > 0 THEN NULL
            ELSE SUM(COALESCE(t.nan, 0) + COALESCE(t.posinf, 0) + COALESCE(t.neginf, 0)) END AS nonfinite
FROM tensors t
JOIN steps st ON st.id = t.step_id
JOIN runs r ON r.id = st.run_id
JOIN nodes n ON n.id = t.node_id
WHERE t.role IN (0, 1)
  AND t.node_id IN (  -- start from the run's (and module's) nodes: an index lookup, not a table scan
      SELECT n2.id FROM nodes n2 JOIN runs r2 ON r2.id = n2.run_id
      WHERE (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r2.name = NULLIF(CAST(:run AS TEXT), ''))
        AND (NULLIF(CAST(:module AS TEXT), '') IS NULL OR n2.module = NULLIF(CAST(:module AS TEXT), '')
             OR SUBSTR(n2.module, 1, LENGTH(NULLIF(CAST(:module AS TEXT), '')) + 1) = NULLIF(CAST(:module AS TEXT), '') || '.'))
  AND (CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER) IS NULL OR st.rank = CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER))
  AND (CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL OR st.step = CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER))
  AND t.step_id IN (  -- the run's steps too: with node_id, one seek per (step, node) in the table
      SELECT st2.id FROM steps st2 JOIN runs r2 ON r2.id = st2.run_id
      WHERE (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r2.name = NULLIF(CAST(:run AS TEXT), ''))
        AND (CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER) IS NULL OR st2.rank = CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER))
        AND (CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL OR st2.step = CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER)))
GROUP BY r.id, r.name, st.rank, st.step,
         CASE WHEN COALESCE(NULLIF(CAST(:by AS TEXT), ''), 'node') = 'module' THEN NULL ELSE n.key END, n.module
ORDER BY r.id, st.step, st.rank, n.module, key;
