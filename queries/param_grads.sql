-- title: Parameter gradients per step
-- description: Each parameter's .grad per step, from one of two rows: the one taken when the step's last top-level backward pass returned (final 0: after gradient accumulation and, under DDP, after the all-reduce) or the one taken when the step ended (final 1: as the optimizer saw it, after any in-place change that followed the pass: a division, GradScaler.unscale_, clipping; pass is NULL). which = 'pass' gives the first, 'final' the second where the step has one and else the first, NULL (or 'all') both. status (none when .grad was None) and statistics over finite elements, exact non-finite counts; a sparse gradient (nn.Embedding(sparse=True)) as the dense tensor it represents, with its layout, nnz and coalesced (NULL when dense). Under FSDP2 or tensor parallelism .grad is a DTensor: its row is this rank's local shard (shape, numel and statistics are the shard's) with the layout: placements, mesh_shape, mesh_dims, coordinate, global_shape, global_offset (NULL for a plain tensor); global_grads combines the ranks' shards. A tied weight is one parameter with one gradient: param is its first name, shared_with its other names (comma-separated, '' for an untied one); asking for any of its names finds it. Why a parameter has no gradient: param_status.
-- param run: run name; empty (NULL) for every run
-- param rank: rank; empty (NULL) for every rank
-- param step: step number; empty (NULL) for every step
-- param param: qualified parameter name (any of a tied weight's names); empty (NULL) for all
-- param which: pass, final or all; empty (NULL) for all
SELECT run, rank, step, pass, final, param, module, status, dtype, shape, numel,
       norm, min, max, mean, std, nan, posinf, neginf, zeros, layout, nnz, coalesced,
       placements, mesh_shape, mesh_dims, coordinate, global_shape, global_offset,
       COALESCE((SELECT pn.shared_with FROM param_names pn WHERE pn.node_id = node_order AND pn.name = param), '')
           AS shared_with
FROM (
    SELECT r.id AS run_order, r.name AS run, st.rank, st.step, p.pass, t.final, n.param, n.module,
           su.name AS status, d.name AS dtype, t.shape, t.numel,
           t.norm, t.min, t.max, t.mean, t.std, t.nan, t.posinf, t.neginf, t.zeros,
           t.layout, t.nnz, t.coalesced, n.id AS node_order,
           dt.placements, dt.mesh_shape, dt.mesh_dims, dt.coordinate, dt.global_shape, dt.global_offset,
           ROW_NUMBER() OVER (PARTITION BY t.step_id, t.node_id, t.final ORDER BY p.pass DESC) AS latest,
           MAX(t.final) OVER (PARTITION BY t.step_id, t.node_id) AS has_final
    FROM tensors t
    JOIN steps st ON st.id = t.step_id
    JOIN runs r ON r.id = st.run_id
    JOIN nodes n ON n.id = t.node_id
    LEFT JOIN passes p ON p.id = t.pass_id
    JOIN statuses su ON su.id = t.status
    LEFT JOIN dtypes d ON d.id = t.dtype
    LEFT JOIN dtensors dt ON dt.id = t.id
    WHERE t.role = 2
      AND t.node_id IN (  -- the parameters' nodes first: an index lookup, not a table scan
          SELECT n2.id FROM nodes n2 JOIN runs r2 ON r2.id = n2.run_id
          WHERE n2.param IS NOT NULL
            AND (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r2.name = NULLIF(CAST(:run AS TEXT), ''))
            AND (NULLIF(CAST(:param AS TEXT), '') IS NULL OR n2.param = NULLIF(CAST(:param AS TEXT), '')
                 OR n2.id IN (SELECT pn.node_id FROM param_names pn WHERE pn.name = NULLIF(CAST(:param AS TEXT), ''))))
      AND (CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER) IS NULL OR st.rank = CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER))
      AND (CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL OR st.step = CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER))
      AND t.step_id IN (  -- the run's steps too: with node_id, one seek per (step, node) in the table
          SELECT st2.id FROM steps st2 JOIN runs r2 ON r2.id = st2.run_id
          WHERE (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r2.name = NULLIF(CAST(:run AS TEXT), ''))
            AND (CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER) IS NULL OR st2.rank = CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER))
            AND (CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL OR st2.step = CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER)))
) AS last_pass
WHERE latest = 1
  AND (NULLIF(CAST(:which AS TEXT), '') IS NULL OR NULLIF(CAST(:which AS TEXT), '') = 'all'
       OR (NULLIF(CAST(:which AS TEXT), '') = 'pass' AND final = 0)
       OR (NULLIF(CAST(:which AS TEXT), '') = 'final' AND (final = 1 OR has_final = 0)))
ORDER BY run_order, step, rank, node_order, final;
