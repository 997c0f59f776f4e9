-- title: Diff of two runs, steps or ranks, node by node
-- description: The gradients (grad_output, grad_input and param_grad rows; saved tensors are left out) and, with record(forward=True), the forward's rows (activation: a module call's outputs; loss: a pass's root; phase forward, gradients phase backward) of two sides (a and b: two runs, two steps of one run, or two ranks) aligned by node key, role, slot and occurrence (the how-manieth row of that key, role and slot in its step: 0 for the first call; micro-batches give 1, 2, ...), statistics side by side (_a, _b), absolute (_abs) and relative (_rel: |a - b| / max(|a|, |b|), 0 when equal) differences of norm, min, max, mean and std. side is both, a (only in side a) or b (only in side b); differs lists the fields that differ bitwise, in this order: status, dtype, shape, nan, posinf, neginf, norm, min, max, mean, std, zeros, and checksum where both sides have one (a statistic NULL on both sides is not compared), '' when none do; a one-sided row is missing (the other side could hold it and does not: its graph differs) or not compared where the other side could not hold it: it recorded no such step (every=, steps=, a shorter run), could not write it (steps status unwritten: a full disk, an I/O error), kept a flight-recorder summary of it, recorded no forward in that step (a forward row, where the other side recorded no activation or loss row: the forward was not compared), hooks no node (stats='params'), or its run's graph held the node while none of its compared steps recorded a gradient of it (modules= / params= filters); where a side is at stats='health', mean, std and zeros are not compared; not compared where a side's values were not measured (a row skipped on either side, or recorded without statistics: only dtype and shape are compared, and a difference there is listed instead); reason says why for missing and not compared rows. Ordered by step, rank and side a's execution order (seq, the step's counter shared by the forward's module calls and losses and the backward calls, so a forward row comes at its place in time; param_grad rows after their pass's calls, the step's final param_grad rows, taken when it ended, after all its passes and as their last occurrence); rows only in b come last in b's order. id_a and id_b are the tensor rows' ids; values_a and values_b the bytes of elements stored with record(values=...), NULL where none were. This file compares statistics only (SQL cannot decode the elements portably): Store.diff compares the stored elements of both sides in Python and adds values_compared, values_max_abs, values_rel and values_cosine. A row whose two sides hold different pieces of one DTensor (their layouts: a Shard placement at different offsets, or different Partial terms) is not compared either (differs = not compared, or dtype where the dtypes differ; reason names both layouts): its values differ by design; Replicate copies are compared as any row. So is, between two different ranks, a plain row that holds each rank's own local piece of a DTensor (not compared; reason says so): under tensor parallelism, a gradient of a node joined by edges, through nodes with no DTensor gradient, to the plain side of a node that turns a Shard DTensor into its local tensor or back (to_local / from_local: the plain side's shape is not the global one), and, with record(forward=True), a module call's plain output whose gradient where it enters the module is such a piece or a Shard of the output's shape (the activation between a column- and a row-parallel layer).
-- param run_a: side a's run name; empty (NULL): run_b's (both empty: each run against itself)
-- param run_b: side b's run name; empty (NULL): run_a's (two steps or two ranks of one run)
-- param step_a: side a's step; empty (NULL): step_b's (both empty: every step, paired by step number)
-- param step_b: side b's step; empty (NULL): step_a's
-- param rank_a: side a's rank; empty (NULL): rank_b's (both empty: every rank, paired by rank)
-- param rank_b: side b's rank; empty (NULL): rank_a's
WITH RECURSIVE prm AS (  -- a NULL side takes the other side's value
    SELECT COALESCE(NULLIF(CAST(:run_a AS TEXT), ''), NULLIF(CAST(:run_b AS TEXT), '')) AS run_a,
           COALESCE(NULLIF(CAST(:run_b AS TEXT), ''), NULLIF(CAST(:run_a AS TEXT), '')) AS run_b,
           COALESCE(CAST(NULLIF(CAST(:step_a AS TEXT), '') AS INTEGER), CAST(NULLIF(CAST(:step_b AS TEXT), '') AS INTEGER)) AS step_a,
           COALESCE(CAST(NULLIF(CAST(:step_b AS TEXT), '') AS INTEGER), CAST(NULLIF(CAST(:step_a AS TEXT), '') AS INTEGER)) AS step_b,
           COALESCE(CAST(NULLIF(CAST(:rank_a AS TEXT), '') AS INTEGER), CAST(NULLIF(CAST(:rank_b AS TEXT), '') AS INTEGER)) AS rank_a,
           COALESCE(CAST(NULLIF(CAST(:rank_b AS TEXT), '') AS INTEGER), CAST(NULLIF(CAST(:rank_a AS TEXT), '') AS INTEGER)) AS rank_b
), a AS (  -- side a's gradients and forward rows, with their position in execution order
    SELECT t.id AS tid, t.step_id AS sid, t.node_id AS nid, st.run_id, st.rank, st.step, n.key, t.role, t.slot,
           ROW_NUMBER() OVER (PARTITION BY t.step_id, t.node_id, t.role, t.slot
                              ORDER BY t.final, p.pass, COALESCE(c.seq, f.seq), t.id) - 1 AS occurrence,
           -- seq: the step's counter (a call's; a forward row's from forward_seqs); NULL for a param_grad row
           -- (its pass's last seq comes from ends)
           COALESCE(c.seq, f.seq) AS seq, t.pass_id AS pid,
           COALESCE(p.pass, -1) AS pass
    FROM tensors t
    JOIN steps st ON st.id = t.step_id
    JOIN nodes n ON n.id = t.node_id
    LEFT JOIN passes p ON p.id = t.pass_id
    LEFT JOIN calls c ON c.id = t.call_id
    LEFT JOIN forward_seqs f ON f.id = t.id  -- record(forward=True): an activation or loss row's place in the step
    -- gradients (grad_output, grad_input, param_grad; not saved tensors) and, with record(forward=True), the
    -- forward's rows (activation: a module call's outputs; loss: a pass's root), which come first in time
    WHERE t.role IN (0, 1, 2, 4, 5)
      AND t.step_id IN (  -- the side's steps first: an index lookup, not a table scan
          SELECT st2.id FROM steps st2 JOIN runs r2 ON r2.id = st2.run_id CROSS JOIN prm
          WHERE (prm.run_a IS NULL OR r2.name = prm.run_a)
            AND (prm.step_a IS NULL OR st2.step = prm.step_a)
            AND (prm.rank_a IS NULL OR st2.rank = prm.rank_a))
), b AS (  -- side b's gradients and forward rows, with their position in execution order
    SELECT t.id AS tid, t.step_id AS sid, t.node_id AS nid, st.run_id, st.rank, st.step, n.key, t.role, t.slot,
           ROW_NUMBER() OVER (PARTITION BY t.step_id, t.node_id, t.role, t.slot
                              ORDER BY t.final, p.pass, COALESCE(c.seq, f.seq), t.id) - 1 AS occurrence,
           -- seq: the step's counter (a call's; a forward row's from forward_seqs); NULL for a param_grad row
           -- (its pass's last seq comes from ends)
           COALESCE(c.seq, f.seq) AS seq, t.pass_id AS pid,
           COALESCE(p.pass, -1) AS pass
    FROM tensors t
    JOIN steps st ON st.id = t.step_id
    JOIN nodes n ON n.id = t.node_id
    LEFT JOIN passes p ON p.id = t.pass_id
    LEFT JOIN calls c ON c.id = t.call_id
    LEFT JOIN forward_seqs f ON f.id = t.id  -- record(forward=True): an activation or loss row's place in the step
    -- gradients (grad_output, grad_input, param_grad; not saved tensors) and, with record(forward=True), the
    -- forward's rows (activation: a module call's outputs; loss: a pass's root), which come first in time
    WHERE t.role IN (0, 1, 2, 4, 5)
      AND t.step_id IN (  -- the side's steps first: an index lookup, not a table scan
          SELECT st2.id FROM steps st2 JOIN runs r2 ON r2.id = st2.run_id CROSS JOIN prm
          WHERE (prm.run_b IS NULL OR r2.name = prm.run_b)
            AND (prm.step_b IS NULL OR st2.step = prm.step_b)
            AND (prm.rank_b IS NULL OR st2.rank = prm.rank_b))
), ends AS (  -- the last seq of each pass with param_grad rows, which sort after their pass's calls
    SELECT p.id AS pid, MAX(c.seq) AS seq
    FROM passes p
    -- a pass's calls: the id range first_call..last_call (unary + keeps SQLite's planner on that range)
    JOIN calls c ON c.id BETWEEN p.first_call AND p.last_call AND +c.pass_id = +p.id
    WHERE p.id IN (SELECT pid FROM a WHERE seq IS NULL UNION SELECT pid FROM b WHERE seq IS NULL)
    GROUP BY p.id
), akeys AS (  -- the node keys each side recorded a row of (p = 1: a param_grad row, 2: a forward row, 0: a node's gradient)
    SELECT DISTINCT key, CASE WHEN role = 2 THEN 1 WHEN role IN (4, 5) THEN 2 ELSE 0 END AS p FROM a
), bkeys AS (
    SELECT DISTINCT key, CASE WHEN role = 2 THEN 1 WHEN role IN (4, 5) THEN 2 ELSE 0 END AS p FROM b
), afwd AS (  -- side a's steps that recorded the forward (activation or loss rows: record(forward=True))
    SELECT DISTINCT sid FROM a WHERE role IN (4, 5)
), bfwd AS (
    SELECT DISTINCT sid FROM b WHERE role IN (4, 5)
), side_steps AS (  -- the steps of both sides
    SELECT sid FROM a UNION SELECT sid FROM b
), drows AS (  -- the sides' DTensor gradient rows (grad_output, grad_input): their layouts
    SELECT td.id, td.step_id AS sid, td.node_id AS nid, td.role, td.slot, l.shape, sh.placements, sh.global_shape
    FROM tensor_data td
    JOIN tensor_shardings x ON x.id = td.id
    JOIN shardings sh ON sh.id = x.sharding_id
    LEFT JOIN layouts l ON l.id = td.layout_id
    WHERE td.step_id IN (SELECT sid FROM side_steps) AND td.role IN (0, 1)
), conv AS (  -- nodes that turn this rank's shard of a DTensor into a plain tensor or back (DTensor.to_local /
    -- from_local under tensor parallelism): a Shard row on one side, a plain row of another shape than the global
    -- one on the other (plain_role: the role of the plain side, this rank's local piece)
    SELECT DISTINCT d.sid, d.nid, pl.role AS plain_role
    FROM drows d
    JOIN tensor_data pl ON pl.step_id = d.sid AND pl.node_id = d.nid AND pl.role IN (0, 1) AND pl.role <> d.role
    JOIN layouts lp ON lp.id = pl.layout_id
    WHERE d.placements LIKE '%Shard(%' AND lp.shape <> d.global_shape
      AND NOT EXISTS (SELECT 1 FROM tensor_shardings px WHERE px.id = pl.id)
), region (sid, nid) AS (  -- the nodes of plain gradients joined by edges to a converter's plain side, through
    -- nodes that ran in the step with no DTensor gradient: each rank's local piece flows through them
    SELECT c.sid, CASE WHEN c.plain_role = 1 THEN e.dst ELSE e.src END
    FROM conv c
    JOIN edges e ON (c.plain_role = 1 AND e.src = c.nid) OR (c.plain_role = 0 AND e.dst = c.nid)
    WHERE EXISTS (SELECT 1 FROM tensor_data t WHERE t.step_id = c.sid AND t.role IN (0, 1)
                    AND t.node_id = CASE WHEN c.plain_role = 1 THEN e.dst ELSE e.src END)
      AND NOT EXISTS (SELECT 1 FROM drows d WHERE d.sid = c.sid AND d.nid = CASE WHEN c.plain_role = 1 THEN e.dst ELSE e.src END)
    UNION
    SELECT r.sid, CASE WHEN e.src = r.nid THEN e.dst ELSE e.src END
    FROM region r
    JOIN edges e ON e.src = r.nid OR e.dst = r.nid
    WHERE EXISTS (SELECT 1 FROM tensor_data t WHERE t.step_id = r.sid AND t.role IN (0, 1)
                    AND t.node_id = CASE WHEN e.src = r.nid THEN e.dst ELSE e.src END)
      AND NOT EXISTS (SELECT 1 FROM drows d WHERE d.sid = r.sid AND d.nid = CASE WHEN e.src = r.nid THEN e.dst ELSE e.src END)
), gpiece AS (  -- plain gradient rows that hold this rank's local piece: a converter's plain side, the region's rows
    SELECT pl.id, pl.step_id AS sid, pl.node_id AS nid, pl.role, pl.slot, pl.layout_id
    FROM conv c JOIN tensor_data pl ON pl.step_id = c.sid AND pl.node_id = c.nid AND pl.role = c.plain_role
    UNION
    SELECT t.id, t.step_id, t.node_id, t.role, t.slot, t.layout_id
    FROM region r JOIN tensor_data t ON t.step_id = r.sid AND t.node_id = r.nid AND t.role IN (0, 1)
), pieces AS (  -- every row that is this rank's local piece: those gradients, and (record(forward=True)) a module
    -- call's plain output whose gradient, where it enters the module (a grad_output fed by an edge from a node outside
    -- the module), has the output's shape and is such a piece or a DTensor shard (a Shard placement, not the whole)
    SELECT id FROM gpiece
    UNION
    SELECT f.id
    FROM (SELECT id, sid, nid, slot, layout_id FROM gpiece WHERE role = 0
          UNION
          SELECT d.id, d.sid, d.nid, d.slot, td.layout_id FROM drows d
          JOIN tensor_data td ON td.step_id = d.sid AND td.node_id = d.nid AND td.id = d.id
          WHERE d.role = 0 AND d.placements LIKE '%Shard(%' AND d.shape <> d.global_shape) g
    JOIN nodes gn ON gn.id = g.nid
    JOIN edges e ON e.dst = g.nid AND e.dst_slot = g.slot
    JOIN nodes sn ON sn.id = e.src
    JOIN nodes fn ON fn.run_id = gn.run_id AND fn.kind = 5 AND fn.module <> ''
                 AND (gn.module = fn.module OR SUBSTR(gn.module, 1, LENGTH(fn.module) + 1) = fn.module || '.')
                 AND NOT (sn.module = fn.module OR SUBSTR(sn.module, 1, LENGTH(fn.module) + 1) = fn.module || '.')
    JOIN tensor_data f ON f.step_id = g.sid AND f.node_id = fn.id AND f.role = 4
    JOIN layouts lf ON lf.id = f.layout_id
    JOIN layouts lg ON lg.id = g.layout_id
    WHERE lf.shape = lg.shape AND NOT EXISTS (SELECT 1 FROM tensor_shardings fx WHERE fx.id = f.id)
), pairs AS (  -- a full outer join written as LEFT JOIN + the anti-join (portable); why: for a row of one side
    -- only, why the other side cannot hold it (NULL: it could, so the row is missing there): the other side did not
    -- record that step, kept a flight-recorder summary of it, recorded no forward in that step (a forward row),
    -- hooks no node (stats='params'), or its run's graph held the node while none of its compared steps recorded a
    -- row of it (modules= / params= filters)
    SELECT a.sid AS a_sid, a.nid AS a_nid, a.tid AS a_tid, b.sid AS b_sid, b.nid AS b_nid, b.tid AS b_tid, a.occurrence,
           COALESCE(a.seq, ea.seq, CASE WHEN a.pid IS NULL THEN 2147483647 ELSE -1 END) AS a_ord,
           CASE WHEN b.tid IS NOT NULL THEN COALESCE(b.seq, eb.seq, CASE WHEN b.pid IS NULL THEN 2147483647 ELSE -1 END) END AS b_ord,
           CASE WHEN b.tid IS NULL THEN CASE WHEN ob.id IS NULL THEN 'not compared: side b recorded no step ' || a.step || ' of rank ' || a.rank
                WHEN ob.status = 'unwritten' THEN 'not compared: side b''s step ' || ob.step || ' was not written (the writer could not write it: steps.error says why)'
                WHEN ob.level = 'summary' THEN 'not compared: side b kept only a flight-recorder summary of step ' || ob.step
                WHEN a.role IN (4, 5) AND ob.id NOT IN (SELECT sid FROM bfwd)
                     THEN 'not compared: side b recorded no forward in step ' || ob.step || ' (no activation or loss '
                          || 'rows: record(forward=True) was off, or stats=''params''), so the forward was not compared'
                WHEN a.role IN (0, 1) AND ob.level = 'params'
                     THEN 'not compared: side b was recorded at stats=''params'', which hooks no node'
                WHEN ob.run_id <> a.run_id
                     AND NOT EXISTS (SELECT 1 FROM bkeys k WHERE k.key = a.key AND k.p = CASE WHEN a.role = 2 THEN 1 WHEN a.role IN (4, 5) THEN 2 ELSE 0 END)
                     AND EXISTS (SELECT 1 FROM nodes n2 WHERE n2.run_id = ob.run_id AND n2.key = a.key)
                     THEN 'not compared: side b''s graph held this node, but none of its compared steps recorded a '
                          || CASE WHEN a.role IN (4, 5) THEN 'forward row' ELSE 'gradient' END
                          || ' of it (no hook on it there: record(modules=...) or params= filters)' END END AS why
    FROM a CROSS JOIN prm
    LEFT JOIN b ON b.key = a.key AND b.role = a.role AND b.slot = a.slot AND b.occurrence = a.occurrence
        AND (prm.run_a IS NOT NULL OR b.run_id = a.run_id)
        AND (prm.step_a IS NOT NULL OR b.step = a.step)
        AND (prm.rank_a IS NOT NULL OR b.rank = a.rank)
    LEFT JOIN ends ea ON ea.pid = a.pid AND a.seq IS NULL
    LEFT JOIN ends eb ON eb.pid = b.pid AND b.seq IS NULL
    LEFT JOIN steps ob ON ob.run_id = COALESCE((SELECT r.id FROM runs r WHERE r.name = prm.run_b), a.run_id)
        AND ob.step = COALESCE(prm.step_b, a.step) AND ob.rank = COALESCE(prm.rank_b, a.rank)
    UNION ALL
    SELECT NULL, NULL, NULL, b.sid, b.nid, b.tid, b.occurrence, NULL, COALESCE(b.seq, eb.seq, CASE WHEN b.pid IS NULL THEN 2147483647 ELSE -1 END),
           CASE WHEN oa.id IS NULL THEN 'not compared: side a recorded no step ' || b.step || ' of rank ' || b.rank
                WHEN oa.status = 'unwritten' THEN 'not compared: side a''s step ' || oa.step || ' was not written (the writer could not write it: steps.error says why)'
                WHEN oa.level = 'summary' THEN 'not compared: side a kept only a flight-recorder summary of step ' || oa.step
                WHEN b.role IN (4, 5) AND oa.id NOT IN (SELECT sid FROM afwd)
                     THEN 'not compared: side a recorded no forward in step ' || oa.step || ' (no activation or loss '
                          || 'rows: record(forward=True) was off, or stats=''params''), so the forward was not compared'
                WHEN b.role IN (0, 1) AND oa.level = 'params'
                     THEN 'not compared: side a was recorded at stats=''params'', which hooks no node'
                WHEN oa.run_id <> b.run_id
                     AND NOT EXISTS (SELECT 1 FROM akeys k WHERE k.key = b.key AND k.p = CASE WHEN b.role = 2 THEN 1 WHEN b.role IN (4, 5) THEN 2 ELSE 0 END)
                     AND EXISTS (SELECT 1 FROM nodes n2 WHERE n2.run_id = oa.run_id AND n2.key = b.key)
                     THEN 'not compared: side a''s graph held this node, but none of its compared steps recorded a '
                          || CASE WHEN b.role IN (4, 5) THEN 'forward row' ELSE 'gradient' END
                          || ' of it (no hook on it there: record(modules=...) or params= filters)' END
    FROM b CROSS JOIN prm
    LEFT JOIN ends eb ON eb.pid = b.pid AND b.seq IS NULL
    LEFT JOIN steps oa ON oa.run_id = COALESCE((SELECT r.id FROM runs r WHERE r.name = prm.run_a), b.run_id)
        AND oa.step = COALESCE(prm.step_a, b.step) AND oa.rank = COALESCE(prm.rank_a, b.rank)
    WHERE NOT EXISTS (SELECT 1 FROM a WHERE b.key = a.key AND b.role = a.role AND b.slot = a.slot AND b.occurrence = a.occurrence
                                         AND (prm.run_a IS NOT NULL OR b.run_id = a.run_id)
                                         AND (prm.step_a IS NOT NULL OR b.step = a.step)
                                         AND (prm.rank_a IS NOT NULL OR b.rank = a.rank))
)
SELECT ra.name AS run_a,
       rb.name AS run_b,
       sa.rank AS rank_a,
       sb.rank AS rank_b,
       sa.step AS step_a,
       sb.step AS step_b,
       pa.pass AS pass_a,
       pb.pass AS pass_b,
       COALESCE(ca.seq, fa.seq) AS seq_a,
       COALESCE(cb.seq, fb.seq) AS seq_b,
       COALESCE(na.key, nb.key) AS key,
       COALESCE(na.name, nb.name) AS name,
       COALESCE(na.module, nb.module) AS module,
       COALESCE(na.param, nb.param) AS param,
       ro.name AS role,
       COALESCE(ta.slot, tb.slot) AS slot,
       pr.occurrence,
       CASE WHEN ta.id IS NULL THEN 'b' WHEN tb.id IS NULL THEN 'a' ELSE 'both' END AS side,
       CASE WHEN ta.id IS NULL OR tb.id IS NULL THEN CASE WHEN pr.why IS NULL THEN 'missing' ELSE 'not compared' END
            WHEN (xa.id IS NOT NULL AND xb.id IS NOT NULL AND (COALESCE(xa.global_offset <> xb.global_offset, FALSE) OR COALESCE(xa.shard <> xb.shard, FALSE) OR (xa.partials > 1 AND COALESCE(xa.partial <> xb.partial, TRUE))))
                 THEN CASE WHEN COALESCE(ta.dtype <> tb.dtype, FALSE) THEN 'dtype' ELSE 'not compared' END
            WHEN (pca.id IS NOT NULL OR pcb.id IS NOT NULL) AND sa.rank <> sb.rank  -- two ranks' own local pieces
                 THEN CASE WHEN COALESCE(ta.dtype <> tb.dtype, FALSE) THEN 'dtype' ELSE 'not compared' END
        WHEN ta.status = 2 OR tb.status = 2 OR (ta.status = 0 AND tb.status = 0 AND (ta.norm IS NULL OR tb.norm IS NULL)
                  AND (ta.checksum IS NULL OR tb.checksum IS NULL))
             THEN COALESCE(NULLIF(RTRIM(CASE WHEN COALESCE(ta.dtype <> tb.dtype, ta.dtype IS NOT NULL OR tb.dtype IS NOT NULL) THEN 'dtype,' ELSE '' END
             || CASE WHEN COALESCE(ta.shape <> tb.shape, ta.shape IS NOT NULL OR tb.shape IS NOT NULL) THEN 'shape,' ELSE '' END, ','), ''), 'not compared')
        ELSE RTRIM(CASE WHEN COALESCE(ta.status <> tb.status, ta.status IS NOT NULL OR tb.status IS NOT NULL) THEN 'status,' ELSE '' END
             || CASE WHEN COALESCE(ta.dtype <> tb.dtype, ta.dtype IS NOT NULL OR tb.dtype IS NOT NULL) THEN 'dtype,' ELSE '' END
             || CASE WHEN COALESCE(ta.shape <> tb.shape, ta.shape IS NOT NULL OR tb.shape IS NOT NULL) THEN 'shape,' ELSE '' END
             || CASE WHEN COALESCE(ta.nan <> tb.nan, ta.nan IS NOT NULL OR tb.nan IS NOT NULL) THEN 'nan,' ELSE '' END
             || CASE WHEN COALESCE(ta.posinf <> tb.posinf, ta.posinf IS NOT NULL OR tb.posinf IS NOT NULL) THEN 'posinf,' ELSE '' END
             || CASE WHEN COALESCE(ta.neginf <> tb.neginf, ta.neginf IS NOT NULL OR tb.neginf IS NOT NULL) THEN 'neginf,' ELSE '' END
             || CASE WHEN COALESCE(ta.norm <> tb.norm, ta.norm IS NOT NULL OR tb.norm IS NOT NULL) THEN 'norm,' ELSE '' END
             || CASE WHEN COALESCE(ta.min <> tb.min, ta.min IS NOT NULL OR tb.min IS NOT NULL) THEN 'min,' ELSE '' END
             || CASE WHEN COALESCE(ta.max <> tb.max, ta.max IS NOT NULL OR tb.max IS NOT NULL) THEN 'max,' ELSE '' END
             || CASE WHEN sa.level <> 'health' AND sb.level <> 'health' AND COALESCE(ta.mean <> tb.mean, ta.mean IS NOT NULL OR tb.mean IS NOT NULL) THEN 'mean,' ELSE '' END
             || CASE WHEN sa.level <> 'health' AND sb.level <> 'health' AND COALESCE(ta.std <> tb.std, ta.std IS NOT NULL OR tb.std IS NOT NULL) THEN 'std,' ELSE '' END
             || CASE WHEN sa.level <> 'health' AND sb.level <> 'health' AND COALESCE(ta.zeros <> tb.zeros, ta.zeros IS NOT NULL OR tb.zeros IS NOT NULL) THEN 'zeros,' ELSE '' END
             || CASE WHEN ta.checksum <> tb.checksum THEN 'checksum,' ELSE '' END, ',') END AS differs,
       sua.name AS status_a,
       sub.name AS status_b,
       da.name AS dtype_a,
       db.name AS dtype_b,
       ta.shape AS shape_a,
       tb.shape AS shape_b,
       ta.numel AS numel_a,
       tb.numel AS numel_b,
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
       CASE WHEN ta.id IS NULL THEN COALESCE(pr.why, 'only in side b') WHEN tb.id IS NULL THEN COALESCE(pr.why, 'only in side a')
            WHEN (xa.id IS NOT NULL AND xb.id IS NOT NULL AND (COALESCE(xa.global_offset <> xb.global_offset, FALSE) OR COALESCE(xa.shard <> xb.shard, FALSE) OR (xa.partials > 1 AND COALESCE(xa.partial <> xb.partial, TRUE))))
                 THEN 'not compared: different ' || CASE WHEN xa.partials > 1 AND COALESCE(xa.partial <> xb.partial, TRUE) AND COALESCE(xa.global_offset = xb.global_offset, TRUE) THEN 'Partial terms' ELSE 'shards' END
                      || ' of one DTensor (' || COALESCE(xa.placements, '?') || ' at offset ' || COALESCE(xa.global_offset, '?')
                      || CASE WHEN xa.partials > 1 THEN ', Partial term ' || CAST(xa.partial AS TEXT) ELSE '' END || ' vs '
                      || COALESCE(xb.placements, '?') || ' at offset ' || COALESCE(xb.global_offset, '?')
                      || CASE WHEN xb.partials > 1 THEN ', Partial term ' || CAST(xb.partial AS TEXT) ELSE '' END
                      || '): their values differ by design'
            WHEN (pca.id IS NOT NULL OR pcb.id IS NOT NULL) AND sa.rank <> sb.rank
                 THEN 'not compared: each rank''s own local piece of a DTensor (a plain tensor between DTensor ops under '
                      || 'tensor parallelism, e.g. the activation between a column- and a row-parallel layer: rank '
                      || CAST(sa.rank AS TEXT) || '''s piece vs rank ' || CAST(sb.rank AS TEXT)
                      || '''s, found from the converters to_local / from_local next to it): their values differ by design'
            WHEN ta.status = 2 THEN 'skipped on side a: ' || COALESCE(ta.reason, 'no reason recorded')
            WHEN tb.status = 2 THEN 'skipped on side b: ' || COALESCE(tb.reason, 'no reason recorded')
            WHEN (ta.status = 0 AND tb.status = 0 AND (ta.norm IS NULL OR tb.norm IS NULL)
                  AND (ta.checksum IS NULL OR tb.checksum IS NULL))
                 THEN 'no statistics on side ' || CASE WHEN ta.norm IS NULL THEN 'a' ELSE 'b' END
                      || ' (recorded at stats=''shape''): only dtype and shape compared'
            WHEN sa.level = 'health' OR sb.level = 'health'
                 THEN 'mean, std and zeros not compared: side ' || CASE WHEN sa.level = 'health' THEN 'a' ELSE 'b' END
                      || ' was recorded at stats=''health'', which does not measure them' END AS reason,
       ta.id AS id_a,
       tb.id AS id_b,
       LENGTH(va.data) AS values_a,
       LENGTH(vb.data) AS values_b,
       CASE WHEN COALESCE(ta.role, tb.role) IN (4, 5) THEN 'forward' ELSE 'backward' END AS phase
FROM pairs pr
LEFT JOIN tensors ta ON ta.step_id = pr.a_sid AND ta.node_id = pr.a_nid AND ta.id = pr.a_tid
LEFT JOIN tensors tb ON tb.step_id = pr.b_sid AND tb.node_id = pr.b_nid AND tb.id = pr.b_tid
LEFT JOIN steps sa ON sa.id = ta.step_id
LEFT JOIN steps sb ON sb.id = tb.step_id
LEFT JOIN runs ra ON ra.id = sa.run_id
LEFT JOIN runs rb ON rb.id = sb.run_id
LEFT JOIN nodes na ON na.id = ta.node_id
LEFT JOIN nodes nb ON nb.id = tb.node_id
LEFT JOIN passes pa ON pa.id = ta.pass_id
LEFT JOIN passes pb ON pb.id = tb.pass_id
LEFT JOIN calls ca ON ca.id = ta.call_id
LEFT JOIN calls cb ON cb.id = tb.call_id
LEFT JOIN forward_seqs fa ON fa.id = ta.id
LEFT JOIN forward_seqs fb ON fb.id = tb.id
LEFT JOIN statuses sua ON sua.id = ta.status
LEFT JOIN statuses sub ON sub.id = tb.status
LEFT JOIN dtypes da ON da.id = ta.dtype
LEFT JOIN dtypes db ON db.id = tb.dtype
LEFT JOIN tensor_values va ON va.id = ta.id
LEFT JOIN tensor_values vb ON vb.id = tb.id
LEFT JOIN dtensors xa ON xa.id = ta.id  -- the layouts: which piece of a DTensor each side holds
LEFT JOIN dtensors xb ON xb.id = tb.id
LEFT JOIN pieces pca ON pca.id = ta.id  -- this rank's local piece (a plain tensor between DTensor ops)
LEFT JOIN pieces pcb ON pcb.id = tb.id
JOIN roles ro ON ro.id = COALESCE(ta.role, tb.role)
CROSS JOIN prm
ORDER BY CASE WHEN prm.run_a IS NULL THEN COALESCE(sa.run_id, sb.run_id) END,
         CASE WHEN prm.step_a IS NULL THEN COALESCE(sa.step, sb.step) END,
         CASE WHEN prm.rank_a IS NULL THEN COALESCE(sa.rank, sb.rank) END,
         CASE WHEN ta.id IS NULL THEN 1 ELSE 0 END, COALESCE(pr.a_ord, pr.b_ord), COALESCE(pa.pass, pb.pass),
         CASE WHEN COALESCE(ta.role, tb.role) = 2 THEN 1 ELSE 0 END, COALESCE(na.key, nb.key), pr.occurrence,
         COALESCE(ta.role, tb.role), COALESCE(ta.slot, tb.slot);
