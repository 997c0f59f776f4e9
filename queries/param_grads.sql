-- title: Parameter gradients per step
-- description: Each parameter's .grad as it stood when the step's last top-level backward pass returned (after gradient accumulation and, under DDP, after the all-reduce): status (none when .grad was None) and statistics over finite elements, exact non-finite counts.
-- param run: run name; empty (NULL) for every run
-- param rank: rank; empty (NULL) for every rank
-- param step: step number; empty (NULL) for every step
-- param param: qualified parameter name; empty (NULL) for all
SELECT run, rank, step, pass, param, module, status, dtype, shape, numel,
       norm, min, max, mean, std, nan, posinf, neginf, zeros
FROM (
    SELECT r.id AS run_order, r.name AS run, st.rank, st.step, p.pass, n.param, n.module,
           su.name AS status, d.name AS dtype, t.shape, t.numel,
           t.norm, t.min, t.max, t.mean, t.std, t.nan, t.posinf, t.neginf, t.zeros, n.id AS node_order,
           ROW_NUMBER() OVER (PARTITION BY t.step_id, t.node_id ORDER BY p.pass DESC) AS latest
    FROM tensors t
    JOIN steps st ON st.id = t.step_id
    JOIN runs r ON r.id = st.run_id
    JOIN nodes n ON n.id = t.node_id
    JOIN passes p ON p.id = t.pass_id
    JOIN statuses su ON su.id = t.status
    LEFT JOIN dtypes d ON d.id = t.dtype
    WHERE t.role = 2
      AND t.node_id IN (  -- the parameters' nodes first: an index lookup, not a table scan
          SELECT n2.id FROM nodes n2 JOIN runs r2 ON r2.id = n2.run_id
          WHERE n2.param IS NOT NULL
            AND (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r2.name = NULLIF(CAST(:run AS TEXT), ''))
            AND (NULLIF(CAST(:param AS TEXT), '') IS NULL OR n2.param = NULLIF(CAST(:param AS TEXT), '')))
      AND (CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER) IS NULL OR st.rank = CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER))
      AND (CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL OR st.step = CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER))
      AND t.step_id IN (  -- the run's steps too: with node_id, one seek per (step, node) in the table
          SELECT st2.id FROM steps st2 JOIN runs r2 ON r2.id = st2.run_id
          WHERE (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r2.name = NULLIF(CAST(:run AS TEXT), ''))
            AND (CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER) IS NULL OR st2.rank = CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER))
            AND (CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL OR st2.step = CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER)))
) AS last_pass
WHERE latest = 1
ORDER BY run_order, step, rank, node_order;
