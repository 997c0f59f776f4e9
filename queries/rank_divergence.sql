-- title: Parameter gradients that differ across ranks
-- description: At each step, every parameter whose final gradient (its param_grad row of the step's last top-level backward pass: .grad after gradient accumulation and, under DDP, after the all-reduce) differs between the lowest rank that recorded the step (rank_a) and another rank (rank_b): one row per parameter and differing rank. Compared by checksum where both ranks have one (compared = checksum: a bitwise comparison), else by every statistic (compared = statistics: status, dtype, shape, the nan/posinf/neginf counts, norm, min, max, mean, std and the zeros count must be equal). differs lists the fields that differ, in that order (missing: the parameter has a param_grad row on one rank only; side says which). Statistics side by side (_a, _b) with absolute and relative differences as in the diff query. Empty when every rank agrees (or only one rank recorded the step).
-- param run: run name; empty (NULL) for every run
-- param step: step number; empty (NULL) for every step
WITH latest_rows AS (  -- each rank's param_grad rows, the latest pass first
    SELECT t.id AS tid, t.step_id AS sid, st.run_id, st.step, st.rank, t.node_id,
           ROW_NUMBER() OVER (PARTITION BY t.step_id, t.node_id ORDER BY p.pass DESC) AS latest
    FROM tensors t
    JOIN steps st ON st.id = t.step_id
    JOIN passes p ON p.id = t.pass_id
    WHERE t.role = 2
      AND t.node_id IN (  -- the parameters' nodes first: an index lookup, not a table scan
          SELECT n2.id FROM nodes n2 JOIN runs r2 ON r2.id = n2.run_id
          WHERE n2.param IS NOT NULL
            AND (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r2.name = NULLIF(CAST(:run AS TEXT), '')))
      AND (CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL OR st.step = CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER))
      AND t.step_id IN (  -- the run's steps too: with node_id, one seek per (step, node) in the table
          SELECT st2.id FROM steps st2 JOIN runs r2 ON r2.id = st2.run_id
          WHERE (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r2.name = NULLIF(CAST(:run AS TEXT), ''))
            AND (CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL OR st2.step = CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER)))
), g AS (
    SELECT tid, sid, run_id, step, rank, node_id FROM latest_rows WHERE latest = 1
), ref AS (  -- the reference rank of each step: the lowest that recorded it
    SELECT st.run_id, st.step, MIN(st.rank) AS rank
    FROM steps st JOIN runs r ON r.id = st.run_id
    WHERE (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r.name = NULLIF(CAST(:run AS TEXT), ''))
      AND (CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL OR st.step = CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER))
    GROUP BY st.run_id, st.step
), other_ranks AS (  -- every other rank that recorded the step
    SELECT st.run_id, st.step, ref.rank AS rank_a, st.rank AS rank_b
    FROM steps st JOIN ref ON ref.run_id = st.run_id AND ref.step = st.step
    WHERE st.rank > ref.rank
), pairs AS (  -- a full outer join written as LEFT JOIN + the anti-join (portable)
    SELECT o.run_id, o.step, o.rank_a, o.rank_b, ga.node_id, ga.sid AS a_sid, ga.tid AS a_tid, gb.sid AS b_sid, gb.tid AS b_tid
    FROM other_ranks o
    JOIN g ga ON ga.run_id = o.run_id AND ga.step = o.step AND ga.rank = o.rank_a
    LEFT JOIN g gb ON gb.run_id = o.run_id AND gb.step = o.step AND gb.rank = o.rank_b AND gb.node_id = ga.node_id
    UNION ALL
    SELECT o.run_id, o.step, o.rank_a, o.rank_b, gb.node_id, NULL, NULL, gb.sid, gb.tid
    FROM other_ranks o
    JOIN g gb ON gb.run_id = o.run_id AND gb.step = o.step AND gb.rank = o.rank_b
    WHERE NOT EXISTS (SELECT 1 FROM g ga WHERE ga.run_id = o.run_id AND ga.step = o.step AND ga.rank = o.rank_a
                                           AND ga.node_id = gb.node_id)
), compared AS (
    SELECT r.name AS run,
           pr.step,
           n.param,
           n.module,
           pr.rank_a,
           pr.rank_b,
           CASE WHEN ta.id IS NULL THEN 'b' WHEN tb.id IS NULL THEN 'a' ELSE 'both' END AS side,
           CASE WHEN ta.checksum IS NOT NULL AND tb.checksum IS NOT NULL THEN 'checksum' ELSE 'statistics' END AS compared,
           CASE WHEN ta.id IS NULL OR tb.id IS NULL THEN 'missing'
                WHEN ta.checksum IS NOT NULL AND tb.checksum IS NOT NULL THEN
                 CASE WHEN ta.checksum = tb.checksum THEN ''
                      ELSE RTRIM('checksum,' || CASE WHEN COALESCE(ta.status <> tb.status, ta.status IS NOT NULL OR tb.status IS NOT NULL) THEN 'status,' ELSE '' END
             || CASE WHEN COALESCE(ta.dtype <> tb.dtype, ta.dtype IS NOT NULL OR tb.dtype IS NOT NULL) THEN 'dtype,' ELSE '' END
             || CASE WHEN COALESCE(ta.shape <> tb.shape, ta.shape IS NOT NULL OR tb.shape IS NOT NULL) THEN 'shape,' ELSE '' END
             || CASE WHEN COALESCE(ta.nan <> tb.nan, ta.nan IS NOT NULL OR tb.nan IS NOT NULL) THEN 'nan,' ELSE '' END
             || CASE WHEN COALESCE(ta.posinf <> tb.posinf, ta.posinf IS NOT NULL OR tb.posinf IS NOT NULL) THEN 'posinf,' ELSE '' END
             || CASE WHEN COALESCE(ta.neginf <> tb.neginf, ta.neginf IS NOT NULL OR tb.neginf IS NOT NULL) THEN 'neginf,' ELSE '' END
             || CASE WHEN COALESCE(ta.norm <> tb.norm, ta.norm IS NOT NULL OR tb.norm IS NOT NULL) THEN 'norm,' ELSE '' END
             || CASE WHEN COALESCE(ta.min <> tb.min, ta.min IS NOT NULL OR tb.min IS NOT NULL) THEN 'min,' ELSE '' END
             || CASE WHEN COALESCE(ta.max <> tb.max, ta.max IS NOT NULL OR tb.max IS NOT NULL) THEN 'max,' ELSE '' END
             || CASE WHEN COALESCE(ta.mean <> tb.mean, ta.mean IS NOT NULL OR tb.mean IS NOT NULL) THEN 'mean,' ELSE '' END
             || CASE WHEN COALESCE(ta.std <> tb.std, ta.std IS NOT NULL OR tb.std IS NOT NULL) THEN 'std,' ELSE '' END
             || CASE WHEN COALESCE(ta.zeros <> tb.zeros, ta.zeros IS NOT NULL OR tb.zeros IS NOT NULL) THEN 'zeros,' ELSE '' END, ',') END
                ELSE RTRIM(CASE WHEN COALESCE(ta.status <> tb.status, ta.status IS NOT NULL OR tb.status IS NOT NULL) THEN 'status,' ELSE '' END
             || CASE WHEN COALESCE(ta.dtype <> tb.dtype, ta.dtype IS NOT NULL OR tb.dtype IS NOT NULL) THEN 'dtype,' ELSE '' END
             || CASE WHEN COALESCE(ta.shape <> tb.shape, ta.shape IS NOT NULL OR tb.shape IS NOT NULL) THEN 'shape,' ELSE '' END
             || CASE WHEN COALESCE(ta.nan <> tb.nan, ta.nan IS NOT NULL OR tb.nan IS NOT NULL) THEN 'nan,' ELSE '' END
             || CASE WHEN COALESCE(ta.posinf <> tb.posinf, ta.posinf IS NOT NULL OR tb.posinf IS NOT NULL) THEN 'posinf,' ELSE '' END
             || CASE WHEN COALESCE(ta.neginf <> tb.neginf, ta.neginf IS NOT NULL OR tb.neginf IS NOT NULL) THEN 'neginf,' ELSE '' END
             || CASE WHEN COALESCE(ta.norm <> tb.norm, ta.norm IS NOT NULL OR tb.norm IS NOT NULL) THEN 'norm,' ELSE '' END
             || CASE WHEN COALESCE(ta.min <> tb.min, ta.min IS NOT NULL OR tb.min IS NOT NULL) THEN 'min,' ELSE '' END
             || CASE WHEN COALESCE(ta.max <> tb.max, ta.max IS NOT NULL OR tb.max IS NOT NULL) THEN 'max,' ELSE '' END
             || CASE WHEN COALESCE(ta.mean <> tb.mean, ta.mean IS NOT NULL OR tb.mean IS NOT NULL) THEN 'mean,' ELSE '' END
             || CASE WHEN COALESCE(ta.std <> tb.std, ta.std IS NOT NULL OR tb.std IS NOT NULL) THEN 'std,' ELSE '' END
             || CASE WHEN COALESCE(ta.zeros <> tb.zeros, ta.zeros IS NOT NULL OR tb.zeros IS NOT NULL) THEN 'zeros,' ELSE '' END, ',') END AS differs,
           sua.name AS status_a,
           sub.name AS status_b,
           ta.shape AS shape_a,
           tb.shape AS shape_b,
           ta.norm AS norm_a,
           tb.norm AS norm_b,
           ABS(ta.norm - tb.norm) AS norm_abs,
           CASE WHEN ta.norm = tb.norm THEN 0.0 ELSE ABS(ta.norm - tb.norm) / (CASE WHEN ABS(ta.norm) >= ABS(tb.norm) THEN ABS(ta.norm) ELSE ABS(tb.norm) END) END AS norm_rel,
           ta.min AS min_a,
           tb.min AS min_b,
           ABS(ta.min - tb.min) AS min_abs,
           CASE WHEN ta.min = tb.min THEN 0.0 ELSE ABS(ta.min - tb.min) / (CASE WHEN ABS(ta.min) >= ABS(tb.min) THEN ABS(ta.min) ELSE ABS(tb.min) END) END AS min_rel,
           ta.max AS max_a,
           tb.max AS max_b,
           ABS(ta.max - tb.max) AS max_abs,
           CASE WHEN ta.max = tb.max THEN 0.0 ELSE ABS(ta.max - tb.max) / (CASE WHEN ABS(ta.max) >= ABS(tb.max) THEN ABS(ta.max) ELSE ABS(tb.max) END) END AS max_rel,
           ta.mean AS mean_a,
           tb.mean AS mean_b,
           ABS(ta.mean - tb.mean) AS mean_abs,
           CASE WHEN ta.mean = tb.mean THEN 0.0 ELSE ABS(ta.mean - tb.mean) / (CASE WHEN ABS(ta.mean) >= ABS(tb.mean) THEN ABS(ta.mean) ELSE ABS(tb.mean) END) END AS mean_rel,
           ta.std AS std_a,
           tb.std AS std_b,
           ABS(ta.std - tb.std) AS std_abs,
           CASE WHEN ta.std = tb.std THEN 0.0 ELSE ABS(ta.std - tb.std) / (CASE WHEN ABS(ta.std) >= ABS(tb.std) THEN ABS(ta.std) ELSE ABS(tb.std) END) END AS std_rel,
           ta.nan AS nan_a,
           tb.nan AS nan_b,
           ta.posinf AS posinf_a,
           tb.posinf AS posinf_b,
           ta.neginf AS neginf_a,
           tb.neginf AS neginf_b,
           ta.zeros AS zeros_a,
           tb.zeros AS zeros_b,
           ta.checksum AS checksum_a,
           tb.checksum AS checksum_b,
           pr.run_id AS o_run, pr.node_id AS o_node
    FROM pairs pr
    JOIN runs r ON r.id = pr.run_id
    JOIN nodes n ON n.id = pr.node_id
    LEFT JOIN tensors ta ON ta.step_id = pr.a_sid AND ta.node_id = pr.node_id AND ta.id = pr.a_tid
    LEFT JOIN tensors tb ON tb.step_id = pr.b_sid AND tb.node_id = pr.node_id AND tb.id = pr.b_tid
    LEFT JOIN statuses sua ON sua.id = ta.status
    LEFT JOIN statuses sub ON sub.id = tb.status
)
SELECT run, step, param, module, rank_a, rank_b, side, compared, differs, status_a, status_b, shape_a, shape_b, norm_a, norm_b, norm_abs, norm_rel, min_a, min_b, min_abs, min_rel, max_a, max_b, max_abs, max_rel, mean_a, mean_b, mean_abs, mean_rel, std_a, std_b, std_abs, std_rel, nan_a, nan_b, posinf_a, posinf_b, neginf_a, neginf_b, zeros_a, zeros_b, checksum_a, checksum_b
FROM compared
WHERE differs <> ''
ORDER BY o_run, step, o_node, rank_b;
