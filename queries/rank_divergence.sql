-- title: Parameter gradients that differ across ranks, or could not be compared
-- description: At each step, every parameter's gradient on each rank at two stages (stage): backward, its param_grad row of the step's last top-level backward pass (.grad after gradient accumulation and after DDP's all-reduce or FSDP2's reduce-scatter); final, its final row where the step has one (.grad as the optimizer saw it: after GradScaler.unscale_, clipping or a division by hand), compared with another rank's by the rule its layout calls for. rule replicated: the ranks hold the same values (a plain tensor, as DDP's all-reduced .grad; or a DTensor's copies along Replicate mesh dimensions, same shard and Partial term): each rank is compared with the lowest rank holding that region (rank_a), by checksum where both have one (compared = checksum: bitwise), else by every statistic (compared = statistics: status, dtype, shape, placements, the nan/posinf/neginf counts, norm, min, max, mean, std and the zeros count must be equal; a statistic NULL on both sides is not compared; reason then names the rank without a checksum: equal statistics are not a bitwise comparison), or by status where neither has a gradient (compared = status: .grad None on both). rule sharded / partial: the ranks hold different shards (Shard / _StridedShard placements) or different Partial terms of a DTensor, whose values differ by design: only the layout is compared (compared = layout: status, dtype, placements, mesh and global shape), with the lowest rank holding the parameter (rank_a). rule missing: a rank of the run (0 .. world_size - 1, and any rank that wrote a step) has no param_grad row for the parameter: it recorded the step without one, or recorded no such step (reason: rank R recorded no step S, and where it recorded into this database how its recording stands: still running, interrupted after its last step written (its process died: the steps it had not written are lost), ended with an error at a step, or finished after its last step; else whether it wrote other steps of the run to this database), or could not write the step (status unwritten: reason says step S was not written on rank R), not compared (side says which rank has one). rule none: .grad is None on both ranks: no values to compare and no placement to read (replicated or sharded is not known from these rows): not compared; where FSDP2's gradient sync was off on both ranks (passes.fsdp_sync 0, or 2: off for some modules) reason says 'gradient accumulating inside FSDP2 (set_requires_gradient_sync(False) ...): not yet reduce-scattered into .grad'. result: differs (differs lists the fields), not compared (reason says why: a row missing, skipped, or recorded without statistics on either side, a rank that recorded no such step or could not write it, or .grad None on both: nothing is claimed about its values), equal, sharded (layouts agree; values not compared, by design) or local: a backward row of rule replicated that differs (differs lists the fields) where the gradients were reduced after the pass (a hand-written all-reduce between backward() and the optimizer): its pair of ranks' final rows compared by value and agree, or, in the same step, some other pair's final rows agree where their backward rows differ; each rank's .grad after the pass is then its own local gradient (different where the ranks see different data), and the final rows are the comparison that counts. A replicated row of a plain tensor (not a DTensor, whose placement says its copies are kept equal) is not compared (accumulation = 1) where no optimizer stepped in the step on either rank (steps.optimizer_steps 0) and DDP did not all-reduce the step's last top-level backward pass on both (passes.ddp_sync 1), where DDP's sync was off on a rank (passes.ddp_sync 0) or, without DDP, both ranks' optimizers stepped in other recorded steps of the run (so the steps without one are micro-batches; where no recorded step has one the optimizer runs outside them, and the rows are compared as ever): each rank's .grad is then its own accumulation (DDP no_sync, gradient accumulation over recorded micro-batches), expected to differ; reason says so, and names the ranks whose DDP sync was off; where an optimizer stepped the rows are compared as ever, and a row that differs with DDP's sync off on a rank says so in reason (no_sync left on for the optimizer's micro-batch). optimizer_steps_a/_b, ddp_sync_a/_b and fsdp_sync_a/_b give each side's. Only differs and not compared rows unless all = 1. Statistics side by side (_a, _b) with absolute and relative differences as in the diff query.
-- param run: run name; empty (NULL) for every run
-- param step: step number; empty (NULL) for every step
-- param all: 1 to list every comparison (the equal and sharded ones too); empty (NULL): only those that differ or were not compared
-- param now: the current time in seconds since the epoch (gradstore binds it): where a rank recorded no such step, its reason says whether its recording is still running, ended, or was interrupted (its lease ran out at that time; queries/run_ranks.sql); empty (NULL): no lease is judged
-- param dead: claims ids (comma-separated) whose holder the reader found gone (gradstore binds the claims held on its own host whose pid is dead); empty (NULL): leases only
WITH RECURSIVE prm AS (
    SELECT CASE WHEN CAST(:now AS TEXT) = '' THEN NULL ELSE CAST(:now AS DOUBLE PRECISION) END AS now,
           ',' || COALESCE(CAST(:dead AS TEXT), '') || ',' AS dead
), rank_ends AS (  -- each claimed rank's status, as queries/run_ranks.sql gives it, with its last step written
    SELECT c.run_id, c.rank, c.pid, c.host, c.ended_step, c.error,
           CASE WHEN c.released_at IS NOT NULL THEN COALESCE(c.status, 'interrupted')
                WHEN prm.now IS NOT NULL AND (c.heartbeat_at + c.lease < prm.now
                                              OR prm.dead LIKE ('%,' || CAST(c.id AS TEXT) || ',%'))
                     THEN 'interrupted'
                ELSE COALESCE(c.status, 'running') END AS status,
           (SELECT MAX(x.step) FROM steps x WHERE x.run_id = c.run_id AND x.rank = c.rank AND x.status <> 'unwritten') AS last_step
    FROM claims c CROSS JOIN prm
), latest_rows AS (  -- each rank's param_grad rows by stage: the latest pass's first ('backward'); the final row ('final')
    SELECT t.id AS tid, t.step_id AS sid, st.run_id, st.step, st.rank, t.node_id,
           CASE WHEN t.pass_id IS NULL THEN 'final' ELSE 'backward' END AS stage,
           ROW_NUMBER() OVER (PARTITION BY t.step_id, t.node_id, t.pass_id IS NULL ORDER BY p.pass DESC) AS latest
    FROM tensors t
    JOIN steps st ON st.id = t.step_id
    LEFT JOIN passes p ON p.id = t.pass_id
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
), g AS (  -- per stage, the row of each parameter on each rank, with its layout: which region it holds
    SELECT l.tid, l.sid, l.run_id, l.step, l.rank, l.node_id, l.stage,
           CASE WHEN d.id IS NULL THEN -1 ELSE COALESCE(d.shard, -2) END AS shard,  -- -1: a plain tensor
           COALESCE(d.partial, 0) AS term,
           d.placements, d.mesh_shape, d.global_shape, d.global_offset
    FROM latest_rows l
    LEFT JOIN dtensors d ON d.id = l.tid
    WHERE l.latest = 1
), lowest AS (  -- per parameter and stage: the lowest rank that has a row
    SELECT run_id, step, stage, node_id, MIN(rank) AS rank FROM g GROUP BY run_id, step, stage, node_id
), holders AS (  -- per region (shard and Partial term) and stage: the lowest rank that holds it
    SELECT run_id, step, stage, node_id, shard, term, MIN(rank) AS rank FROM g GROUP BY run_id, step, stage, node_id, shard, term
), world (run_id, rank) AS (  -- the ranks of each run: 0 .. world_size - 1
    SELECT r.id, 0 FROM runs r
    WHERE NULLIF(CAST(:run AS TEXT), '') IS NULL OR r.name = NULLIF(CAST(:run AS TEXT), '')
    UNION ALL
    SELECT w.run_id, w.rank + 1 FROM world w JOIN runs r ON r.id = w.run_id WHERE w.rank + 1 < r.world_size
), run_ranks AS (  -- every rank of each run: its world, and any rank that wrote a step
    SELECT run_id, rank FROM world
    UNION
    SELECT st.run_id, st.rank FROM steps st WHERE st.run_id IN (SELECT run_id FROM world)
), recorded AS (  -- per step some rank recorded: every rank of the run, whether it recorded that step (has_step;
    -- a step it could not write, status unwritten, counts: its row says so) and whether it recorded any step of the run
    -- in this database (has_any)
    SELECT s.run_id, s.step, k.rank,
           CASE WHEN EXISTS (SELECT 1 FROM steps x WHERE x.run_id = s.run_id AND x.step = s.step AND x.rank = k.rank)
                THEN 1 ELSE 0 END AS has_step,
           CASE WHEN EXISTS (SELECT 1 FROM steps x WHERE x.run_id = s.run_id AND x.rank = k.rank) THEN 1 ELSE 0 END AS has_any
    FROM (SELECT DISTINCT st.run_id, st.step
          FROM steps st JOIN runs r ON r.id = st.run_id
          WHERE (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r.name = NULLIF(CAST(:run AS TEXT), ''))
            AND (CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL OR st.step = CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER))) s
    JOIN run_ranks k ON k.run_id = s.run_id
), pairs AS (
    -- a copy of a region, against the region's lowest holder: must agree
    SELECT b.run_id, b.step, b.stage, b.node_id, h.rank AS rank_a, b.rank AS rank_b, 'replicated' AS rule,
           a.sid AS a_sid, a.tid AS a_tid, b.sid AS b_sid, b.tid AS b_tid, 1 AS has_step, 1 AS has_any
    FROM g b
    JOIN holders h ON h.run_id = b.run_id AND h.step = b.step AND h.stage = b.stage AND h.node_id = b.node_id
                  AND h.shard = b.shard AND h.term = b.term AND h.rank < b.rank
    JOIN g a ON a.run_id = b.run_id AND a.step = b.step AND a.stage = b.stage AND a.node_id = b.node_id AND a.rank = h.rank
    UNION ALL
    -- another region's lowest holder, against the parameter's lowest rank: different values by design
    SELECT b.run_id, b.step, b.stage, b.node_id, lo.rank, b.rank,
           CASE WHEN a.shard <> b.shard OR a.shard < 0 OR b.shard < 0 THEN 'sharded' ELSE 'partial' END,
           a.sid, a.tid, b.sid, b.tid, 1, 1
    FROM g b
    JOIN holders h ON h.run_id = b.run_id AND h.step = b.step AND h.stage = b.stage AND h.node_id = b.node_id
                  AND h.shard = b.shard AND h.term = b.term AND h.rank = b.rank
    JOIN lowest lo ON lo.run_id = b.run_id AND lo.step = b.step AND lo.stage = b.stage AND lo.node_id = b.node_id
                  AND lo.rank < b.rank
    JOIN g a ON a.run_id = b.run_id AND a.step = b.step AND a.stage = b.stage AND a.node_id = b.node_id AND a.rank = lo.rank
    UNION ALL
    -- a rank of the run without a row for the parameter: it recorded the step (has_step = 1) or did not
    SELECT lo.run_id, lo.step, lo.stage, lo.node_id,
           CASE WHEN rc.rank < lo.rank THEN rc.rank ELSE lo.rank END,
           CASE WHEN rc.rank < lo.rank THEN lo.rank ELSE rc.rank END,
           'missing',
           CASE WHEN rc.rank < lo.rank THEN NULL ELSE a.sid END, CASE WHEN rc.rank < lo.rank THEN NULL ELSE a.tid END,
           CASE WHEN rc.rank < lo.rank THEN a.sid ELSE NULL END, CASE WHEN rc.rank < lo.rank THEN a.tid ELSE NULL END,
           rc.has_step, rc.has_any
    FROM lowest lo
    JOIN recorded rc ON rc.run_id = lo.run_id AND rc.step = lo.step
    JOIN g a ON a.run_id = lo.run_id AND a.step = lo.step AND a.stage = lo.stage AND a.node_id = lo.node_id
                AND a.rank = lo.rank
    WHERE NOT EXISTS (SELECT 1 FROM g x WHERE x.run_id = lo.run_id AND x.step = lo.step AND x.stage = lo.stage
                                          AND x.node_id = lo.node_id AND x.rank = rc.rank)
), sides AS (
    SELECT pr.*, ta.id AS ida, tb.id AS idb,
           ta.status AS sa, tb.status AS sb, ta.reason AS reason_a, tb.reason AS reason_b,
           ta.dtype AS dtype_a, tb.dtype AS dtype_b, ta.shape AS shape_a, tb.shape AS shape_b,
           ta.norm AS norm_a, tb.norm AS norm_b, ta.min AS min_a, tb.min AS min_b, ta.max AS max_a, tb.max AS max_b,
           ta.mean AS mean_a, tb.mean AS mean_b, ta.std AS std_a, tb.std AS std_b,
           ta.nan AS nan_a, tb.nan AS nan_b, ta.posinf AS posinf_a, tb.posinf AS posinf_b,
           ta.neginf AS neginf_a, tb.neginf AS neginf_b, ta.zeros AS zeros_a, tb.zeros AS zeros_b,
           ta.checksum AS checksum_a, tb.checksum AS checksum_b, ta.layout AS layout_a, tb.layout AS layout_b,
           da.placements AS placements_a, db.placements AS placements_b,
           da.mesh_shape AS mesh_a, db.mesh_shape AS mesh_b, da.global_shape AS global_shape_a,
           db.global_shape AS global_shape_b, da.global_offset AS offset_a, db.global_offset AS offset_b,
           sta.optimizer_steps AS opt_a, stb.optimizer_steps AS opt_b,
           -- DDP's gradient sync in each rank's last top-level backward pass (passes.ddp_sync; NULL: not known)
           (SELECT p.ddp_sync FROM passes p WHERE p.step_id = pr.a_sid AND p.parent_pass IS NULL AND p.kind = 'backward'
            ORDER BY p.pass DESC LIMIT 1) AS sync_a,
           (SELECT p.ddp_sync FROM passes p WHERE p.step_id = pr.b_sid AND p.parent_pass IS NULL AND p.kind = 'backward'
            ORDER BY p.pass DESC LIMIT 1) AS sync_b,
           -- FSDP2's gradient sync in each rank's last top-level backward pass (passes.fsdp_sync: 0 off, 2 off for
           -- some modules: the gradient accumulates inside FSDP2, not yet reduce-scattered into .grad; NULL: not known)
           (SELECT p.fsdp_sync FROM passes p WHERE p.step_id = pr.a_sid AND p.parent_pass IS NULL AND p.kind = 'backward'
            ORDER BY p.pass DESC LIMIT 1) AS fsdp_a,
           (SELECT p.fsdp_sync FROM passes p WHERE p.step_id = pr.b_sid AND p.parent_pass IS NULL AND p.kind = 'backward'
            ORDER BY p.pass DESC LIMIT 1) AS fsdp_b,
           -- whether an optimizer stepped in some recorded step of the run on each rank: its steps without one are
           -- then micro-batches (where no recorded step has one, the optimizer runs outside them: not known)
           CASE WHEN sta.optimizer_steps = 0
                THEN EXISTS (SELECT 1 FROM steps x WHERE x.run_id = sta.run_id AND x.rank = sta.rank
                                                     AND x.optimizer_steps > 0) END AS stepped_a,
           CASE WHEN stb.optimizer_steps = 0
                THEN EXISTS (SELECT 1 FROM steps x WHERE x.run_id = stb.run_id AND x.rank = stb.rank
                                                     AND x.optimizer_steps > 0) END AS stepped_b
    FROM pairs pr
    LEFT JOIN steps sta ON sta.id = pr.a_sid
    LEFT JOIN steps stb ON stb.id = pr.b_sid
    LEFT JOIN tensors ta ON ta.step_id = pr.a_sid AND ta.node_id = pr.node_id AND ta.id = pr.a_tid
    LEFT JOIN tensors tb ON tb.step_id = pr.b_sid AND tb.node_id = pr.node_id AND tb.id = pr.b_tid
    LEFT JOIN dtensors da ON da.id = pr.a_tid
    LEFT JOIN dtensors db ON db.id = pr.b_tid
), fields AS (  -- what differs: the layout (every rule), then the values (rule replicated)
    SELECT sides.*,
           CASE WHEN COALESCE(sa <> sb, sa IS NOT NULL OR sb IS NOT NULL) THEN 'status,' ELSE '' END
           || CASE WHEN COALESCE(dtype_a <> dtype_b, dtype_a IS NOT NULL OR dtype_b IS NOT NULL) THEN 'dtype,' ELSE '' END
           || CASE WHEN COALESCE(placements_a <> placements_b, placements_a IS NOT NULL OR placements_b IS NOT NULL) THEN 'placements,' ELSE '' END
           || CASE WHEN COALESCE(mesh_a <> mesh_b, mesh_a IS NOT NULL OR mesh_b IS NOT NULL) THEN 'mesh_shape,' ELSE '' END
           || CASE WHEN COALESCE(global_shape_a <> global_shape_b, global_shape_a IS NOT NULL OR global_shape_b IS NOT NULL) THEN 'global_shape,' ELSE '' END
           AS layout_diff,
           CASE WHEN COALESCE(shape_a <> shape_b, shape_a IS NOT NULL OR shape_b IS NOT NULL) THEN 'shape,' ELSE '' END
           || CASE WHEN COALESCE(nan_a <> nan_b, nan_a IS NOT NULL OR nan_b IS NOT NULL) THEN 'nan,' ELSE '' END
           || CASE WHEN COALESCE(posinf_a <> posinf_b, posinf_a IS NOT NULL OR posinf_b IS NOT NULL) THEN 'posinf,' ELSE '' END
           || CASE WHEN COALESCE(neginf_a <> neginf_b, neginf_a IS NOT NULL OR neginf_b IS NOT NULL) THEN 'neginf,' ELSE '' END
           || CASE WHEN COALESCE(norm_a <> norm_b, norm_a IS NOT NULL OR norm_b IS NOT NULL) THEN 'norm,' ELSE '' END
           || CASE WHEN COALESCE(min_a <> min_b, min_a IS NOT NULL OR min_b IS NOT NULL) THEN 'min,' ELSE '' END
           || CASE WHEN COALESCE(max_a <> max_b, max_a IS NOT NULL OR max_b IS NOT NULL) THEN 'max,' ELSE '' END
           || CASE WHEN COALESCE(mean_a <> mean_b, mean_a IS NOT NULL OR mean_b IS NOT NULL) THEN 'mean,' ELSE '' END
           || CASE WHEN COALESCE(std_a <> std_b, std_a IS NOT NULL OR std_b IS NOT NULL) THEN 'std,' ELSE '' END
           || CASE WHEN COALESCE(zeros_a <> zeros_b, zeros_a IS NOT NULL OR zeros_b IS NOT NULL) THEN 'zeros,' ELSE '' END
           AS value_diff,
           CASE WHEN (ida IS NULL OR idb IS NULL) AND has_step = 0 THEN 'absent'
                WHEN ida IS NULL OR idb IS NULL THEN 'missing'
                WHEN sa = 2 OR sb = 2 THEN 'skipped'
                -- no optimizer stepped in the step on either rank, and DDP did not all-reduce its last pass on both:
                -- each rank's .grad is its own accumulation (DDP no_sync, gradient accumulation), not synchronised
                -- for an optimizer to read: different by design (a DTensor's Replicate placement says its copies
                -- are kept equal in the pass itself: compared as ever)
                WHEN rule = 'replicated' AND placements_a IS NULL AND placements_b IS NULL
                     AND opt_a = 0 AND opt_b = 0 AND NOT (sa = 1 AND sb = 1)
                     AND NOT (COALESCE(sync_a, 0) = 1 AND COALESCE(sync_b, 0) = 1)
                     AND (sync_a = 0 OR sync_b = 0 OR (stepped_a AND stepped_b)) THEN 'own'
                WHEN rule <> 'replicated' THEN 'layout'
                WHEN sa = 1 AND sb = 1 THEN 'none'
                WHEN sa <> sb THEN 'status'
                WHEN checksum_a IS NOT NULL AND checksum_b IS NOT NULL THEN 'checksum'
                WHEN norm_a IS NOT NULL AND norm_b IS NOT NULL THEN 'statistics'
                ELSE 'unmeasured' END AS how
    FROM sides
), judged AS (
    SELECT fields.*,
           CASE how WHEN 'missing' THEN 'missing'
                    WHEN 'absent' THEN ''
                    WHEN 'skipped' THEN ''
                    WHEN 'own' THEN ''
                    WHEN 'layout' THEN RTRIM(layout_diff, ',')
                    WHEN 'status' THEN RTRIM(layout_diff, ',')
                    WHEN 'none' THEN ''
                    WHEN 'checksum' THEN
                         CASE WHEN checksum_a = checksum_b THEN RTRIM(layout_diff, ',')
                              ELSE RTRIM('checksum,' || layout_diff || value_diff, ',') END
                    WHEN 'statistics' THEN RTRIM(layout_diff || value_diff, ',')
                    ELSE RTRIM(layout_diff || CASE WHEN COALESCE(shape_a <> shape_b, FALSE) THEN 'shape,' ELSE '' END, ',')
           END AS differs
    FROM fields
), finals AS (  -- per step, parameter and pair of ranks: its final rows (.grad as the optimizer read it) compared by
    -- value (by checksum or statistics), and whether they agree
    SELECT run_id, step, node_id, rank_a, rank_b, CASE WHEN differs = '' THEN 1 ELSE 0 END AS agree
    FROM judged
    WHERE stage = 'final' AND rule = 'replicated' AND how IN ('checksum', 'statistics')
), reduced_after AS (  -- the steps whose gradients were made equal after the backward pass: some parameter's rows
    -- after the pass differ on a pair of ranks whose final rows agree (a hand-written all-reduce between
    -- backward() and the optimizer): there each rank's .grad after the pass is its own local gradient
    SELECT DISTINCT j.run_id, j.step
    FROM judged j
    JOIN finals f ON f.run_id = j.run_id AND f.step = j.step AND f.node_id = j.node_id AND f.rank_a = j.rank_a
                 AND f.rank_b = j.rank_b AND f.agree = 1
    WHERE j.stage = 'backward' AND j.rule = 'replicated' AND j.how IN ('checksum', 'statistics') AND j.differs <> ''
), verdicts AS (
    SELECT judged.*,
           CASE WHEN how IN ('missing', 'absent', 'skipped', 'none', 'own') THEN 'not compared'
                -- after the pass, a gradient reduced later (above): each rank's own, different by design where the
                -- ranks see different data; its final rows are the comparison that counts
                WHEN differs <> '' AND stage = 'backward' AND rule = 'replicated' AND how IN ('checksum', 'statistics')
                     AND fin.agree IS NOT NULL AND ra.step IS NOT NULL THEN 'local'
                WHEN differs <> '' THEN 'differs'
                WHEN how = 'unmeasured' THEN 'not compared'
                WHEN how = 'layout' THEN 'sharded'
                ELSE 'equal' END AS result,
           fin.agree AS final_agree
    FROM judged
    LEFT JOIN finals fin ON fin.run_id = judged.run_id AND fin.step = judged.step AND fin.node_id = judged.node_id
                        AND fin.rank_a = judged.rank_a AND fin.rank_b = judged.rank_b AND judged.stage = 'backward'
    LEFT JOIN reduced_after ra ON ra.run_id = judged.run_id AND ra.step = judged.step
)
SELECT r.name AS run,
       v.step,
       v.stage,
       n.param,
       n.module,
       v.rank_a,
       v.rank_b,
       CASE WHEN v.how = 'none' THEN 'none' ELSE v.rule END AS rule,
       v.result,
       CASE WHEN v.ida IS NULL THEN 'b' WHEN v.idb IS NULL THEN 'a' ELSE 'both' END AS side,
       CASE v.how WHEN 'checksum' THEN 'checksum' WHEN 'statistics' THEN 'statistics' WHEN 'status' THEN 'status'
                  WHEN 'none' THEN 'status'
                  WHEN 'layout' THEN 'layout' END AS compared,
       v.differs,
       CASE WHEN v.how = 'absent' THEN 'rank '
                 || CAST(CASE WHEN v.ida IS NULL THEN v.rank_a ELSE v.rank_b END AS TEXT) || ' recorded no step '
                 || CAST(v.step AS TEXT)
                 -- a rank whose steps here end before this one: how its recording stands says why
                 || CASE WHEN ke.status IS NOT NULL AND (ke.last_step IS NULL OR ke.last_step < v.step)
                         THEN ' (it recorded into this database: pid ' || CAST(ke.pid AS TEXT) || ' on ' || ke.host || '; '
                              || CASE WHEN ke.status = 'running'
                                      THEN 'its recording is still running: the step may not be written yet)'
                                      WHEN ke.status = 'interrupted'
                                      THEN 'its process died with its scope open '
                                           || CASE WHEN ke.last_step IS NULL THEN 'before any step of it was written'
                                                   ELSE 'after step ' || CAST(ke.last_step AS TEXT) END
                                           || ': the steps it had not yet written are lost)'
                                      WHEN ke.status = 'error'
                                      THEN 'its recording ended with an error'
                                           || CASE WHEN ke.ended_step IS NULL THEN ''
                                                   ELSE ' at step ' || CAST(ke.ended_step AS TEXT) END
                                           || CASE WHEN ke.error IS NULL THEN '' ELSE ': ' || SUBSTR(ke.error, 1, 200) END || ')'
                                      ELSE 'its recording ' || ke.status || ' '
                                           || CASE WHEN ke.last_step IS NULL THEN 'without writing a step)'
                                                   ELSE 'after step ' || CAST(ke.last_step AS TEXT) || ')' END END
                         WHEN v.has_any = 1
                         THEN ' (it wrote other steps of this run to this database: a rank writes no step in which it '
                              || 'ran no backward pass, nor one that every= or steps= leave out)'
                         ELSE ' (no step of that rank is in this database: record every rank into it, or join the '
                              || 'ranks'' files with gradstore merge)' END
            WHEN v.how = 'missing' AND EXISTS (SELECT 1 FROM steps x WHERE x.run_id = v.run_id AND x.step = v.step
                                                 AND x.rank = CASE WHEN v.ida IS NULL THEN v.rank_a ELSE v.rank_b END
                                                 AND x.status = 'unwritten')
                 THEN 'step ' || CAST(v.step AS TEXT) || ' was not written on rank '
                      || CAST(CASE WHEN v.ida IS NULL THEN v.rank_a ELSE v.rank_b END AS TEXT)
                      || ' (the writer could not write it: steps.error says why): nothing is claimed about its values'
            WHEN v.how = 'missing' AND v.stage = 'final' THEN 'no final row on rank '
                 || CAST(CASE WHEN v.ida IS NULL THEN v.rank_a ELSE v.rank_b END AS TEXT)
                 || ', which recorded the step (its .grad was not read as the optimizer saw it there: no top-level '
                 || 'backward pass, clip_grad_norm_, GradScaler.unscale_ or zero_grad read it in the step on that rank, '
                 || 'or a parameter outside its model=, or filtered by params=)'
            WHEN v.how = 'missing' THEN 'no param_grad row on rank '
                 || CAST(CASE WHEN v.ida IS NULL THEN v.rank_a ELSE v.rank_b END AS TEXT)
                 || ', which recorded the step (its .grad was not read after the backward pass there: no top-level '
                 || 'backward pass on that rank, or a parameter outside its model=, or filtered by params=)'
            WHEN v.how = 'skipped' THEN 'skipped on rank '
                 || CAST(CASE WHEN v.sa = 2 THEN v.rank_a ELSE v.rank_b END AS TEXT) || ': '
                 || COALESCE(CASE WHEN v.sa = 2 THEN v.reason_a ELSE v.reason_b END, 'no reason recorded')
            WHEN v.how = 'none' AND v.fsdp_a IN (0, 2) AND v.fsdp_b IN (0, 2)
                 THEN 'gradient accumulating inside FSDP2 (set_requires_gradient_sync(False)'
                      || CASE WHEN v.fsdp_a = 2 OR v.fsdp_b = 2 THEN ' on some of the FSDP2 modules' ELSE '' END
                      || ' on ranks ' || CAST(v.rank_a AS TEXT) || ' and ' || CAST(v.rank_b AS TEXT)
                      || '): not yet reduce-scattered into .grad, which is None on both ranks: nothing to compare; '
                      || 'the step whose backward pass runs with the sync on is compared'
            WHEN v.how = 'none' THEN '.grad is None on both ranks: no values to compare, and no placement to read '
                 || '(whether the parameter is replicated or sharded is not known from these rows)'
            WHEN v.how = 'own' THEN 'each rank''s own accumulation (DDP no_sync / no optimizer step): '
                 || CASE WHEN v.sync_a = 0 OR v.sync_b = 0
                         THEN 'DDP''s gradient sync was off for the step''s last backward pass on '
                              || CASE WHEN v.sync_a = 0 AND v.sync_b = 0
                                      THEN 'ranks ' || CAST(v.rank_a AS TEXT) || ' and ' || CAST(v.rank_b AS TEXT)
                                      WHEN v.sync_a = 0 THEN 'rank ' || CAST(v.rank_a AS TEXT)
                                      ELSE 'rank ' || CAST(v.rank_b AS TEXT) END
                              || ' (its forward ran under no_sync()), and '
                         ELSE '' END
                 || 'no optimizer stepped in this step on rank ' || CAST(v.rank_a AS TEXT) || ' or rank '
                 || CAST(v.rank_b AS TEXT) || ' (steps.optimizer_steps 0): the .grads were not synchronised for an '
                 || 'optimizer to read, and they are expected to differ; the step whose optimizer reads them is compared'
            WHEN v.result = 'not compared' THEN 'recorded without statistics (stats=''shape''): only status, dtype and shape compared'
            WHEN v.how = 'layout' AND v.result = 'sharded' AND v.rule = 'sharded'
                 THEN 'different shards (offsets ' || COALESCE(v.offset_a, '?') || ' and ' || COALESCE(v.offset_b, '?')
                      || '): values differ by design and are not compared; status, dtype, placements, mesh and global shape agree'
            WHEN v.how = 'layout' AND v.result = 'sharded'
                 THEN 'different Partial terms of the same region: values differ by design and are not compared; status, dtype, placements, mesh and global shape agree'
            WHEN v.result = 'differs' AND v.rule = 'replicated' AND (v.sync_a = 0 OR v.sync_b = 0)
                 THEN 'DDP''s gradient sync was off for the step''s last backward pass on '
                      || CASE WHEN v.sync_a = 0 AND v.sync_b = 0
                              THEN 'ranks ' || CAST(v.rank_a AS TEXT) || ' and ' || CAST(v.rank_b AS TEXT)
                              WHEN v.sync_a = 0 THEN 'rank ' || CAST(v.rank_a AS TEXT)
                              ELSE 'rank ' || CAST(v.rank_b AS TEXT) END
                      || ' (its forward ran under no_sync()) while an optimizer stepped in the step: it read each '
                      || 'rank''s own accumulation, not the all-reduced gradient (run the forward and backward of '
                      || 'the micro-batch before the optimizer step outside no_sync())'
            WHEN v.result = 'local' AND v.final_agree = 1
                 THEN 'each rank''s own gradient after the backward pass, made equal before the optimizer read it (the '
                      || 'final rows agree): a reduction after the pass, e.g. a hand-written all-reduce; expected where '
                      || 'the ranks see different data, not a divergence'
            WHEN v.result = 'local'
                 THEN 'each rank''s own gradient after the backward pass (in this step the gradients were reduced after '
                      || 'the pass: other parameters'' differ after it and agree as the optimizer read them); the final '
                      || 'rows, as the optimizer read them, are the comparison that counts, and they differ'
            WHEN v.how = 'statistics'
                 THEN 'compared by statistics only, not bitwise: no checksum on '
                      || CASE WHEN v.checksum_a IS NULL AND v.checksum_b IS NULL
                              THEN 'ranks ' || CAST(v.rank_a AS TEXT) || ' and ' || CAST(v.rank_b AS TEXT)
                              WHEN v.checksum_a IS NULL THEN 'rank ' || CAST(v.rank_a AS TEXT)
                              ELSE 'rank ' || CAST(v.rank_b AS TEXT) END
                      || CASE WHEN COALESCE(v.layout_a, v.layout_b) LIKE 'sparse%'
                              THEN ' (a sparse gradient, recorded by a gradstore that took no checksum of sparse tensors)'
                              ELSE ' (not taken: record(checksum=False), a process of one rank without '
                                   || 'record(checksum=True), or reading the gradient for it failed)' END
                      || '; equal statistics do not make equal values (elements swapped keep every statistic)'
       END AS reason,
       sua.name AS status_a,
       sub.name AS status_b,
       v.placements_a,
       v.placements_b,
       v.shape_a,
       v.shape_b,
       v.norm_a,
       v.norm_b,
       ABS(v.norm_a - v.norm_b) AS norm_abs,
       CASE WHEN v.norm_a = v.norm_b THEN 0.0 ELSE ABS(v.norm_a - v.norm_b) / (CASE WHEN ABS(v.norm_a) >= ABS(v.norm_b) THEN ABS(v.norm_a) ELSE ABS(v.norm_b) END) END AS norm_rel,
       v.min_a,
       v.min_b,
       ABS(v.min_a - v.min_b) AS min_abs,
       CASE WHEN v.min_a = v.min_b THEN 0.0 ELSE ABS(v.min_a - v.min_b) / (CASE WHEN ABS(v.min_a) >= ABS(v.min_b) THEN ABS(v.min_a) ELSE ABS(v.min_b) END) END AS min_rel,
       v.max_a,
       v.max_b,
       ABS(v.max_a - v.max_b) AS max_abs,
       CASE WHEN v.max_a = v.max_b THEN 0.0 ELSE ABS(v.max_a - v.max_b) / (CASE WHEN ABS(v.max_a) >= ABS(v.max_b) THEN ABS(v.max_a) ELSE ABS(v.max_b) END) END AS max_rel,
       v.mean_a,
       v.mean_b,
       ABS(v.mean_a - v.mean_b) AS mean_abs,
       CASE WHEN v.mean_a = v.mean_b THEN 0.0 ELSE ABS(v.mean_a - v.mean_b) / (CASE WHEN ABS(v.mean_a) >= ABS(v.mean_b) THEN ABS(v.mean_a) ELSE ABS(v.mean_b) END) END AS mean_rel,
       v.std_a,
       v.std_b,
       ABS(v.std_a - v.std_b) AS std_abs,
       CASE WHEN v.std_a = v.std_b THEN 0.0 ELSE ABS(v.std_a - v.std_b) / (CASE WHEN ABS(v.std_a) >= ABS(v.std_b) THEN ABS(v.std_a) ELSE ABS(v.std_b) END) END AS std_rel,
       v.nan_a,
       v.nan_b,
       v.posinf_a,
       v.posinf_b,
       v.neginf_a,
       v.neginf_b,
       v.zeros_a,
       v.zeros_b,
       v.checksum_a,
       v.checksum_b,
       v.opt_a AS optimizer_steps_a,
       v.opt_b AS optimizer_steps_b,
       v.sync_a AS ddp_sync_a,
       v.sync_b AS ddp_sync_b,
       v.fsdp_a AS fsdp_sync_a,
       v.fsdp_b AS fsdp_sync_b,
       CASE WHEN v.how = 'own' THEN 1 ELSE 0 END AS accumulation
FROM verdicts v
JOIN runs r ON r.id = v.run_id
LEFT JOIN rank_ends ke ON v.how = 'absent' AND ke.run_id = v.run_id
                      AND ke.rank = CASE WHEN v.ida IS NULL THEN v.rank_a ELSE v.rank_b END
JOIN nodes n ON n.id = v.node_id
LEFT JOIN statuses sua ON sua.id = v.sa
LEFT JOIN statuses sub ON sub.id = v.sb
WHERE v.result IN ('differs', 'not compared') OR CAST(NULLIF(CAST(:all AS TEXT), '') AS INTEGER) = 1
ORDER BY v.run_id, v.step, v.node_id, v.stage, v.rank_b, v.rank_a;
