-- title: Parameter gradients per step
-- description: Each parameter's .grad per step, from one of two rows: the one taken when the step's last top-level backward pass returned (final 0: after gradient accumulation and, under DDP, after the all-reduce) or the one taken when the step ended (final 1: as the optimizer saw it, after any in-place change that followed the pass: a division, GradScaler.unscale_, clipping; pass is NULL; in a step where no optimizer stepped, steps.optimizer_steps 0, the .grad the step ended with, or that zero_grad cleared). which = 'pass' gives the first, 'final' the second where the step has one and else the first, NULL (or 'all') both. status (none when .grad was None) and statistics over finite elements, exact non-finite counts; a sparse gradient (nn.Embedding(sparse=True)) as the dense tensor it represents, with its layout, nnz and coalesced (NULL when dense). Under FSDP2 or tensor parallelism .grad is a DTensor: its row is this rank's local shard (shape, numel and statistics are the shard's) with the layout: placements, mesh_shape, mesh_dims, coordinate, global_shape, global_offset (NULL for a plain tensor); global_grads combines the ranks' shards. A tied weight is one parameter with one gradient: param is its first name, shared_with its other names (comma-separated, '' for an untied one); asking for any of its names finds it. Why a parameter has no gradient: param_status; its status in the step is column param_status (NULL where the step has no param_status row). no_gradient: where no backward pass of the step gave the parameter a gradient (param_status frozen with no AccumulateGrad call, stale, not used, unreachable), why, and what its .grad holds then: a tensor left from before (an earlier gradient, or the zeros zero_grad(set_to_none=False) writes), which status ok says was measured, not that it is a gradient of this step (an optimizer still applies it); a final row says so only where it matches the step's pass row (a .grad that code set after the pass is not labelled); for a frozen parameter whose AccumulateGrad calls were not recorded (stats='params') it says that whether a pass gave it a gradient is not known; NULL where a pass of the step gave it one, where .grad is None (status none: no value to mistake for one), or where the step has no param_status row; except under FSDP2 with its gradient sync off (passes.fsdp_sync 0, or 2 where off for some modules): a .grad of None (status none) whose parameter got a gradient in the step (param_status ok) says 'gradient accumulating inside FSDP2 (set_requires_gradient_sync(False)): not yet reduce-scattered into .grad', where FSDP2 holds it until a backward pass with the sync on.
-- param run: run name; empty (NULL) for every run
-- param rank: rank; empty (NULL) for every rank
-- param step: step number; empty (NULL) for every step
-- param param: qualified parameter name (any of a tied weight's names); empty (NULL) for all
-- param which: pass, final or all; empty (NULL) for all
SELECT run, rank, step, pass, final, param, module, status,
       param_status,
       -- FSDP2 with its gradient sync off (passes.fsdp_sync 0, or 2: off for some modules): a pass gave the parameter
       -- a gradient (param_status ok) that FSDP2 holds in its unsharded parameter, not yet reduce-scattered into .grad
       CASE WHEN status = 'none' AND param_status = 'ok'
                 AND (SELECT p1.fsdp_sync FROM passes p1
                      WHERE p1.step_id = last_pass.step_id AND p1.parent_pass IS NULL AND p1.kind = 'backward'
                      ORDER BY p1.pass DESC LIMIT 1) IN (0, 2)
            THEN 'gradient accumulating inside FSDP2 (set_requires_gradient_sync(False)'
                 || CASE WHEN (SELECT p1.fsdp_sync FROM passes p1
                               WHERE p1.step_id = last_pass.step_id AND p1.parent_pass IS NULL AND p1.kind = 'backward'
                               ORDER BY p1.pass DESC LIMIT 1) = 2
                         THEN ' on some of the FSDP2 modules' ELSE '' END
                 || '): not yet reduce-scattered into .grad, which is None until a backward pass with the sync on'
            WHEN param_status IN ('frozen', 'stale', 'not used', 'unreachable') AND status <> 'none'
                 AND NOT (param_status = 'frozen' AND COALESCE(ps_calls, 0) > 0)  -- frozen after a pass gave it one
                 -- a final row: only where it is the .grad the step's last pass left (its pass row, the same
                 -- statistics); code may have set .grad after the pass. Looked up for these rare rows only.
                 AND (final = 0
                      OR last_pass.status || ':' || COALESCE(CAST(last_pass.numel AS TEXT), '-') || ':' || COALESCE(CAST(last_pass.norm AS TEXT), '-')
                          || ':' || COALESCE(CAST(last_pass.min AS TEXT), '-') || ':' || COALESCE(CAST(last_pass.max AS TEXT), '-')
                          || ':' || COALESCE(CAST(last_pass.zeros AS TEXT), '-') || ':' || COALESCE(CAST(last_pass.nan AS TEXT), '-')
                          || ':' || COALESCE(CAST(last_pass.posinf AS TEXT), '-') || ':' || COALESCE(CAST(last_pass.neginf AS TEXT), '-')
                         = (SELECT s0.name || ':' || COALESCE(CAST(t0.numel AS TEXT), '-') || ':' || COALESCE(CAST(t0.norm AS TEXT), '-')
                          || ':' || COALESCE(CAST(t0.min AS TEXT), '-') || ':' || COALESCE(CAST(t0.max AS TEXT), '-')
                          || ':' || COALESCE(CAST(t0.zeros AS TEXT), '-') || ':' || COALESCE(CAST(t0.nan AS TEXT), '-')
                          || ':' || COALESCE(CAST(t0.posinf AS TEXT), '-') || ':' || COALESCE(CAST(t0.neginf AS TEXT), '-')
                            FROM tensors t0
                            JOIN statuses s0 ON s0.id = t0.status
                            LEFT JOIN passes p0 ON p0.id = t0.pass_id
                            WHERE t0.step_id = last_pass.step_id AND t0.node_id = last_pass.node_order
                              AND t0.role = 2 AND t0.final = 0
                            ORDER BY p0.pass DESC LIMIT 1))
            THEN CASE param_status
                     WHEN 'frozen' THEN
                          CASE WHEN ps_calls IS NULL
                               THEN 'frozen (requires_grad=False at the end of the step): whether a backward pass '
                                    || 'of the step gave it a gradient is not known (its AccumulateGrad calls are '
                                    || 'not recorded)'
                               ELSE 'frozen (requires_grad=False): no backward pass of the step gave it a gradient'
                          END
                     WHEN 'stale' THEN 'stale: no backward pass of the step gave it a gradient'
                     WHEN 'not used' THEN 'not used: its module did not run, no backward pass of the step gave it a '
                                          || 'gradient'
                     ELSE 'unreachable: no backward pass of the step gave it a gradient'
                 END
                 || CASE WHEN status <> 'ok' OR (param_status = 'frozen' AND ps_calls IS NULL) THEN ''
                         WHEN zeros = numel THEN '; its .grad is all zeros, left from before (as '
                                                 || 'zero_grad(set_to_none=False) leaves it)'
                         WHEN zeros IS NULL THEN '; its .grad (values not measured) is left from before'
                         ELSE '; its .grad holds a tensor left from before (an earlier gradient)'
                    END
                 || CASE WHEN status = 'ok' AND NOT (param_status = 'frozen' AND ps_calls IS NULL)
                         THEN ', which an optimizer holding it still applies: with momentum or weight decay the '
                              || 'parameter still moves'
                         ELSE ''
                    END
       END AS no_gradient,
       dtype, shape, numel,
       norm, min, max, mean, std, nan, posinf, neginf, zeros, layout, nnz, coalesced,
       placements, mesh_shape, mesh_dims, coordinate, global_shape, global_offset,
       COALESCE((SELECT pn.shared_with FROM param_names pn WHERE pn.node_id = node_order AND pn.name = param), '')
           AS shared_with
FROM (
    SELECT r.id AS run_order, r.name AS run, st.rank, st.step, p.pass, t.final, n.param, n.module,
           su.name AS status, d.name AS dtype, t.shape, t.numel,
           t.norm, t.min, t.max, t.mean, t.std, t.nan, t.posinf, t.neginf, t.zeros,
           t.layout, t.nnz, t.coalesced, n.id AS node_order, t.step_id,
           dt.placements, dt.mesh_shape, dt.mesh_dims, dt.coordinate, dt.global_shape, dt.global_offset,
           ps.name AS param_status, x.calls AS ps_calls,
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
    LEFT JOIN param_status x ON x.step_id = t.step_id AND x.node_id = t.node_id
    LEFT JOIN param_statuses ps ON ps.id = x.status
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
