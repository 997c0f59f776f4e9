-- title: Global parameter gradients from every rank's shard
-- description: Per step and parameter, the statistics of the whole gradient (what p.grad.full_tensor() holds) combined from the ranks' param_grad rows of one moment of the step, and the total norm over the parameters. final says which moment: 1, the step's final rows (each .grad as the step left it, when the optimizer read it: after a division, GradScaler.unscale_, clipping, a rank's own change to its shard), 0, the rows taken when the step's last top-level backward pass returned (before any of those). which = 'final' gives the final rows where the step has them (on some rank) and else the pass rows (final = 0: a step recorded before schema revision 0009_loop), 'pass' always the pass rows, NULL (or 'all') both, one row per parameter and moment. A rank without a final row of a parameter in a step whose other ranks have one makes the final combination incomplete (not_derivable names the rank) rather than its pass row standing in. rule says how the rows were combined: sharded (a DTensor with Shard / _StridedShard placements: the regions of the tensor, each counted once, the lowest measured replica of a region where Replicate dimensions copy it), replicated (a plain tensor, as DDP's all-reduced .grad, or a DTensor replicated everywhere: one copy, the lowest rank's) or partial (a DTensor with a Partial placement: each element is the reduction of one term per rank). status is ok (combined from every region), none (.grad was None on every rank) or incomplete (a region's row is missing, skipped, recorded without statistics, the ranks disagree on the layout, or the copies of a region that several ranks hold, which must be equal, differ: a replicated gradient the ranks did not synchronise; nothing is derived; not_derivable says which). numel, norm (sqrt of the sum of squares), min, max, mean, std (Bessel-corrected, from the regions' means and spreads), nan, posinf, neginf and zeros (sums) are exact combinations of the regions' statistics, all over the finite elements as in param_grads. A Partial placement keeps only what per-rank statistics determine: numel, the mean of a Partial(sum) or Partial(avg) gradient (its elements' sum is the sum of the terms' sums) and the max of Partial(max) (the min of Partial(min)), when every term is finite; its norm, the other extremes, std, zeros and non-finite counts depend on how the terms' elements line up and are NULL, and not_derivable names them. total_norm: sqrt of the sum of squared norms over the step's selected parameters that have a gradient (NULL when one of them has no derivable norm: see its not_derivable; NULL, never the finite elements' norm, when one of them holds NaN or +/-Inf: clip_grad_norm_ then returns nan or inf; and NULL, not 0, when none of them has a gradient: every .grad None at that moment, as after a loop that set p.grad = None); with param = NULL it is the norm clip_grad_norm_ computes over all parameters. shards: the rows counted (one per region and Partial term); ranks: the ranks that have a row.
-- param run: run name; empty (NULL) for every run
-- param step: step number; empty (NULL) for every step
-- param param: qualified parameter name; empty (NULL) for all (total_norm then covers every parameter)
-- param which: final, pass or all; empty (NULL) for all (one row per parameter and moment, told apart by final)
WITH latest AS (  -- each rank's param_grad rows: its final row (final = 1) and the latest pass's (final = 0)
    SELECT t.id AS tid, t.step_id AS sid, st.run_id, st.step, st.rank, t.node_id, t.final,
           ROW_NUMBER() OVER (PARTITION BY t.step_id, t.node_id, t.final ORDER BY p.pass DESC) AS latest,
           MAX(t.final) OVER (PARTITION BY t.step_id, t.node_id) AS own_final,
           MAX(t.final) OVER (PARTITION BY st.run_id, st.step) AS step_final
    FROM tensors t
    JOIN steps st ON st.id = t.step_id
    LEFT JOIN passes p ON p.id = t.pass_id
    WHERE t.role = 2
      AND t.node_id IN (  -- the parameters' nodes first: an index lookup, not a table scan
          SELECT n2.id FROM nodes n2 JOIN runs r2 ON r2.id = n2.run_id
          WHERE n2.param IS NOT NULL
            AND (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r2.name = NULLIF(CAST(:run AS TEXT), ''))
            AND (NULLIF(CAST(:param AS TEXT), '') IS NULL OR n2.param = NULLIF(CAST(:param AS TEXT), '')))
      AND t.step_id IN (  -- the run's steps too: with node_id, one seek per (step, node) in the table
          SELECT st2.id FROM steps st2 JOIN runs r2 ON r2.id = st2.run_id
          WHERE (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r2.name = NULLIF(CAST(:run AS TEXT), ''))
            AND (CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL OR st2.step = CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER)))
), moments AS (  -- the moments asked for, per step: final (1) only where some rank has final rows in the step
    SELECT DISTINCT l.run_id, l.step, m.moment
    FROM latest l
    CROSS JOIN (SELECT 0 AS moment UNION ALL SELECT 1 AS moment) m
    WHERE (m.moment = 0 AND (NULLIF(CAST(:which AS TEXT), '') IS NULL OR NULLIF(CAST(:which AS TEXT), '') IN ('all', 'pass')
                             OR (NULLIF(CAST(:which AS TEXT), '') = 'final' AND l.step_final = 0)))
       OR (m.moment = 1 AND l.step_final = 1 AND (NULLIF(CAST(:which AS TEXT), '') IS NULL
                                                  OR NULLIF(CAST(:which AS TEXT), '') IN ('all', 'final')))
), chosen AS (  -- per moment, each rank's row; a rank without a final row keeps its pass row, marked missing
    SELECT l.tid, l.sid, l.run_id, l.step, l.rank, l.node_id, m.moment AS final,
           CASE WHEN m.moment = 1 AND l.final = 0 THEN 1 ELSE 0 END AS no_final
    FROM latest l
    JOIN moments m ON m.run_id = l.run_id AND m.step = l.step
    WHERE l.latest = 1 AND (l.final = m.moment OR (m.moment = 1 AND l.final = 0 AND l.own_final = 0))
), g AS (  -- the final .grad of each parameter on each rank: the local shard's statistics and its layout
    SELECT l.run_id, l.step, l.final, l.rank, l.node_id, l.no_final, t.status, t.numel, t.norm, t.min, t.max, t.mean, t.std,
           t.nan, t.posinf, t.neginf, t.zeros,
           t.numel - t.nan - t.posinf - t.neginf AS nfinite,
           CASE WHEN t.status = 0 AND t.norm IS NOT NULL THEN 1 ELSE 0 END AS measured,
           CASE WHEN d.id IS NULL THEN 0 ELSE 1 END AS is_dtensor,
           d.placements, d.mesh_shape, d.global_shape, d.global_numel, d.partials,
           COALESCE(d.shard, 0) AS shard, COALESCE(d.partial, 0) AS term, COALESCE(d.replica, 0) AS replica
    FROM chosen l
    JOIN tensors t ON t.step_id = l.sid AND t.node_id = l.node_id AND t.id = l.tid
    LEFT JOIN dtensors d ON d.id = l.tid
), picked AS (  -- per region (shard) and Partial term, one copy: the lowest replica that was measured
    SELECT g.*,
           ROW_NUMBER() OVER (PARTITION BY run_id, step, final, node_id, shard, term
                              ORDER BY 1 - measured, replica, rank) AS copy
    FROM g
), agg AS (
    SELECT run_id, step, final, node_id,
           COUNT(*) AS ranks,
           SUM(no_final) AS no_finals,
           MIN(CASE WHEN no_final = 1 THEN rank END) AS no_final_rank,
           SUM(CASE WHEN copy = 1 THEN 1 ELSE 0 END) AS shards,
           SUM(is_dtensor) AS dtensor_rows,
           COUNT(DISTINCT COALESCE(placements, '') || '|' || COALESCE(mesh_shape, '') || '|' || COALESCE(global_shape, '')) AS layouts,
           MIN(placements) AS placements,
           MIN(mesh_shape) AS mesh_shape,
           MIN(global_shape) AS global_shape,
           MIN(global_numel) AS global_numel,
           MIN(partials) AS partials,
           MIN(CASE WHEN copy = 1 THEN numel END) AS copy_numel,
           SUM(CASE WHEN status = 1 THEN 1 ELSE 0 END) AS nones,
           SUM(CASE WHEN status = 0 THEN 1 ELSE 0 END) AS oks,
           SUM(CASE WHEN copy = 1 AND status = 2 THEN 1 ELSE 0 END) AS skipped,
           MIN(CASE WHEN copy = 1 AND status = 2 THEN rank END) AS skipped_rank,
           SUM(CASE WHEN copy = 1 AND status = 0 AND measured = 0 THEN 1 ELSE 0 END) AS unmeasured,
           SUM(CASE WHEN copy = 1 THEN numel ELSE 0 END) AS covered,
           SUM(CASE WHEN copy = 1 THEN norm * norm END) AS sumsq,
           MAX(CASE WHEN copy = 1 THEN norm END) AS one_norm,  -- the norm where one copy holds it all (shards = 1)
           MIN(CASE WHEN copy = 1 THEN min END) AS lo,
           MAX(CASE WHEN copy = 1 THEN max END) AS hi,
           SUM(CASE WHEN copy = 1 THEN nfinite END) AS nfinite,
           SUM(CASE WHEN copy = 1 AND nfinite > 0 THEN mean * nfinite END) AS total,
           SUM(CASE WHEN copy = 1 AND nfinite > 0 AND mean IS NULL THEN 1 ELSE 0 END) AS no_mean,
           SUM(CASE WHEN copy = 1 AND nfinite > 1 THEN (nfinite - 1) * std * std ELSE 0 END) AS within,
           SUM(CASE WHEN copy = 1 AND nfinite > 1 AND std IS NULL THEN 1 ELSE 0 END) AS no_std,
           SUM(CASE WHEN copy = 1 THEN zeros END) AS zeros,
           SUM(CASE WHEN copy = 1 AND status = 0 AND zeros IS NULL THEN 1 ELSE 0 END) AS no_zeros,
           SUM(CASE WHEN copy = 1 THEN nan END) AS nan,
           SUM(CASE WHEN copy = 1 THEN posinf END) AS posinf,
           SUM(CASE WHEN copy = 1 THEN neginf END) AS neginf
    FROM picked
    GROUP BY run_id, step, final, node_id
), split AS (  -- regions whose measured copies (replicas on several ranks) disagree: no one whole gradient
    SELECT run_id, step, final, node_id, COUNT(*) AS regions, MIN(lo_rank) AS lo_rank, MAX(hi_rank) AS hi_rank
    FROM (SELECT run_id, step, final, node_id, shard, term, MIN(rank) AS lo_rank, MAX(rank) AS hi_rank
          FROM g
          WHERE measured = 1
          GROUP BY run_id, step, final, node_id, shard, term
          HAVING MIN(norm) <> MAX(norm) OR MIN(min) <> MAX(min) OR MIN(max) <> MAX(max) OR MIN(numel) <> MAX(numel)
              OR MIN(nan) <> MAX(nan) OR MIN(posinf) <> MAX(posinf) OR MIN(neginf) <> MAX(neginf)
              OR MIN(zeros) <> MAX(zeros)) x
    GROUP BY run_id, step, final, node_id
), kinds AS (  -- how the rows combine, and whether they can
    SELECT agg.*,
           CASE WHEN dtensor_rows = 0 THEN 'replicated'
                WHEN placements LIKE '%Partial(%' THEN 'partial'
                WHEN placements LIKE '%Shard(%' THEN 'sharded'
                ELSE 'replicated' END AS rule,
           CASE WHEN placements NOT LIKE '%Partial(%' OR placements IS NULL THEN NULL
                WHEN placements NOT LIKE '%Partial(avg)%' AND placements NOT LIKE '%Partial(max)%'
                     AND placements NOT LIKE '%Partial(min)%' AND placements NOT LIKE '%Partial(prod%'
                     AND placements LIKE '%Partial(sum)%' THEN 'sum'
                WHEN placements NOT LIKE '%Partial(sum)%' AND placements NOT LIKE '%Partial(max)%'
                     AND placements NOT LIKE '%Partial(min)%' AND placements NOT LIKE '%Partial(prod%'
                     AND placements LIKE '%Partial(avg)%' THEN 'avg'
                WHEN placements NOT LIKE '%Partial(sum)%' AND placements NOT LIKE '%Partial(avg)%'
                     AND placements NOT LIKE '%Partial(min)%' AND placements NOT LIKE '%Partial(prod%'
                     AND placements LIKE '%Partial(max)%' THEN 'max'
                WHEN placements NOT LIKE '%Partial(sum)%' AND placements NOT LIKE '%Partial(avg)%'
                     AND placements NOT LIKE '%Partial(max)%' AND placements NOT LIKE '%Partial(prod%'
                     AND placements LIKE '%Partial(min)%' THEN 'min'
                ELSE 'other' END AS reduce,
           CASE WHEN nones = ranks THEN 'none: .grad is None on every rank'
                WHEN no_finals > 0 THEN 'rank ' || CAST(no_final_rank AS TEXT) || ' has no final row of this parameter in this step (the others do): '
                     || 'its .grad when the optimizer read it was not recorded (which=''pass'' combines the rows of the last backward pass)'
                WHEN dtensor_rows > 0 AND dtensor_rows + nones < ranks THEN 'the ranks disagree: a DTensor on some, a plain tensor on others'
                WHEN layouts > 1 + CASE WHEN nones > 0 THEN 1 ELSE 0 END THEN 'the ranks disagree on the placements, mesh or global shape'
                WHEN nones > 0 AND oks > 0 THEN '.grad is None on some rank while others hold a gradient'
                WHEN sp.regions > 0 THEN 'the ranks'' copies differ (ranks ' || CAST(sp.lo_rank AS TEXT) || ' to '
                     || CAST(sp.hi_rank AS TEXT) || ', in ' || CAST(sp.regions AS TEXT)
                     || ' region(s)): each rank holds its own gradient, not one whole gradient (rank_divergence says where)'
                WHEN skipped > 0 THEN 'a region''s row was skipped (first on rank ' || CAST(skipped_rank AS TEXT) || '): its values were not measured'
                WHEN unmeasured > 0 THEN 'a region was recorded without statistics (stats=''shape'')'
                WHEN dtensor_rows > 0 AND covered <> global_numel * partials
                     THEN 'the rows cover ' || CAST(covered AS TEXT) || ' of ' || CAST(global_numel * partials AS TEXT)
                          || ' elements (terms): a rank''s shard is missing (merge every rank''s database)'
                END AS gap
    FROM agg
    LEFT JOIN split sp ON sp.run_id = agg.run_id AND sp.step = agg.step AND sp.final = agg.final AND sp.node_id = agg.node_id
), combined AS (
    SELECT k.*,
           CASE WHEN gap IS NOT NULL THEN NULL WHEN nfinite > 0 THEN total / CAST(nfinite AS DOUBLE PRECISION) END AS gmean
    FROM kinds k
), spread AS (  -- the regions' spread around the global mean (the between-regions part of the variance)
    SELECT p.run_id, p.step, p.final, p.node_id,
           SUM(CASE WHEN p.nfinite > 0 THEN p.nfinite * (p.mean - c.gmean) * (p.mean - c.gmean) ELSE 0 END) AS across
    FROM picked p
    JOIN combined c ON c.run_id = p.run_id AND c.step = p.step AND c.final = p.final AND c.node_id = p.node_id
    WHERE p.copy = 1 AND c.gmean IS NOT NULL
    GROUP BY p.run_id, p.step, p.final, p.node_id
), result AS (
    SELECT c.run_id, c.step, c.final, c.node_id, c.rule, c.placements, c.mesh_shape, c.global_shape, c.ranks, c.shards,
           CASE WHEN c.gap LIKE 'none:%' THEN 'none' WHEN c.gap IS NOT NULL THEN 'incomplete' ELSE 'ok' END AS status,
           CASE WHEN c.dtensor_rows > 0 THEN c.global_numel ELSE c.copy_numel END AS numel,
           CASE WHEN c.gap IS NULL AND c.rule <> 'partial'
                THEN CASE WHEN c.shards = 1 THEN c.one_norm ELSE SQRT(c.sumsq) END END AS norm,
           CASE WHEN c.gap IS NULL AND (c.rule <> 'partial' OR (c.reduce = 'min' AND c.nan + c.posinf + c.neginf = 0))
                THEN c.lo END AS min,
           CASE WHEN c.gap IS NULL AND (c.rule <> 'partial' OR (c.reduce = 'max' AND c.nan + c.posinf + c.neginf = 0))
                THEN c.hi END AS max,
           CASE WHEN c.gap IS NOT NULL OR c.no_mean > 0 THEN NULL
                WHEN c.rule <> 'partial' THEN c.gmean
                WHEN c.reduce = 'sum' AND c.nan + c.posinf + c.neginf = 0 AND c.global_numel > 0
                     THEN c.total / CAST(c.global_numel AS DOUBLE PRECISION)
                WHEN c.reduce = 'avg' AND c.nan + c.posinf + c.neginf = 0 AND c.global_numel > 0
                     THEN c.total / CAST(c.global_numel * c.partials AS DOUBLE PRECISION) END AS mean,
           CASE WHEN c.gap IS NULL AND c.rule <> 'partial' AND c.no_mean = 0 AND c.no_std = 0 AND c.nfinite > 1
                THEN SQRT((c.within + COALESCE(s.across, 0)) / CAST(c.nfinite - 1 AS DOUBLE PRECISION)) END AS std,
           CASE WHEN c.gap IS NULL AND c.rule <> 'partial' THEN c.nan END AS nan,
           CASE WHEN c.gap IS NULL AND c.rule <> 'partial' THEN c.posinf END AS posinf,
           CASE WHEN c.gap IS NULL AND c.rule <> 'partial' THEN c.neginf END AS neginf,
           CASE WHEN c.gap IS NULL AND c.rule <> 'partial' AND c.no_zeros = 0 THEN c.zeros END AS zeros,
           CASE WHEN c.gap IS NOT NULL AND c.gap NOT LIKE 'none:%' THEN c.gap
                WHEN c.rule = 'partial' THEN
                    CASE WHEN c.reduce IN ('sum', 'avg') THEN 'norm, min, max, std, zeros, nan, posinf, neginf'
                         WHEN c.reduce = 'max' THEN 'norm, min, mean, std, zeros, nan, posinf, neginf'
                         WHEN c.reduce = 'min' THEN 'norm, max, mean, std, zeros, nan, posinf, neginf'
                         ELSE 'norm, min, max, mean, std, zeros, nan, posinf, neginf' END
                    || ': a ' || c.placements || ' gradient is the elementwise reduction of one term per rank; '
                    || 'these statistics depend on how the terms'' elements line up, which per-rank statistics do not record'
                    || CASE WHEN c.nan + c.posinf + c.neginf > 0 THEN ' (and a term holds NaN or Inf)' ELSE '' END
                END AS not_derivable
    FROM combined c
    LEFT JOIN spread s ON s.run_id = c.run_id AND s.step = c.step AND s.final = c.final AND s.node_id = c.node_id
)
SELECT r.name AS run, res.step, res.final, n.param, n.module, res.rule, res.status, res.placements, res.mesh_shape,
       res.global_shape, res.ranks, res.shards, res.numel, res.norm, res.min, res.max, res.mean, res.std,
       res.nan, res.posinf, res.neginf, res.zeros,
       CASE WHEN SUM(CASE WHEN res.status <> 'none' THEN 1 ELSE 0 END)  -- no .grad at all: no norm, not 0
                 OVER (PARTITION BY res.run_id, res.step, res.final) = 0 THEN NULL
            WHEN SUM(CASE WHEN res.status <> 'none' AND (res.norm IS NULL
                                OR COALESCE(res.nan, 0) + COALESCE(res.posinf, 0) + COALESCE(res.neginf, 0) > 0)
                          THEN 1 ELSE 0 END)
                 OVER (PARTITION BY res.run_id, res.step, res.final) > 0 THEN NULL
            ELSE SQRT(SUM(CASE WHEN res.status <> 'none' THEN res.norm * res.norm ELSE 0 END)
                      OVER (PARTITION BY res.run_id, res.step, res.final)) END AS total_norm,
       res.not_derivable
FROM result res
JOIN runs r ON r.id = res.run_id
JOIN nodes n ON n.id = res.node_id
ORDER BY res.run_id, res.step, res.final DESC, res.node_id;
