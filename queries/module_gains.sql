-- title: Gradient gain of every module call, in backward order
-- description: One row per module forward call per step and rank (ordinal: the module's 0th, 1st, ... call in the step), in backward order (first_seq: the seq of the first call of one of its nodes; calls whose nodes never ran last). in_norm: the norm of the gradient w.r.t. the call's outputs, sqrt(sum of squares) over its output tensors and the step's passes; the gradient w.r.t. one output is the sum of what the nodes outside the call send along edges into the slot of the call's node that made it (and the seed of a pass's root inside the call): the grad_output recorded at that slot where every edge into it comes from outside, the one piece where there is one; out_norm: the same w.r.t. the call's inputs (not its own parameters): the sum of the grad_inputs its nodes send into the slot of the outside node that made the input: that node's grad_output where every use of the input is inside the call, the one piece where there is one. Where several pieces of one such gradient meet a piece from the other side (an input also used outside the call, by more than one op inside it), the norm of their sum is not known from their norms: in_norm or out_norm is NULL (no_ratio 'not computed'), never sqrt(sum of squared pieces). in_tensors, out_tensors: the gradients counted (one per output or input tensor and pass), in_unmeasured, out_unmeasured: those not measured. ratio = out_norm / in_norm: above 1 the call amplifies the gradient, below 1 it shrinks it; NULL where a boundary tensor was not measured (in_unmeasured, out_unmeasured: no hooks there, stats='shape', a recorder fault: a skipped row, or a call a fault may have lost), where one held NaN or Inf (nonfinite), where nothing flowed in, or where the module's gradients on this rank include a DTensor piece (a Shard or Partial placement: tensor parallelism): in_norm and out_norm are then norms of this rank's pieces on one side and of whole (replicated) tensors or other pieces on the other, and their quotient is not the module's gain, which no one rank's rows give. A module whose gradients are plain tensors is counted too where one of its nodes is joined by an edge (one that held in that step: of a graph its passes walked) to a node that turns a DTensor shard into this rank's plain local tensor or back (DTensor.to_local / from_local: the plain side's shape is not the global shape): the activation between a ColwiseParallel and a RowwiseParallel layer; a chain of several such plain modules is seen at its ends only. no_ratio says why ratio is NULL (NULL where it has a value). nodes: its nodes that were found; ran: how many of them ran (NULL: not known). during_pass and recomputes: a call re-run inside a backward pass (activation checkpointing) and the call number of the forward call it recomputes. Unlike grad_norms(by='module'), no parameter gradient is in these figures. At stats='params', which walks no graph, in_tensors, out_tensors, in_unmeasured, out_unmeasured, nonfinite and nodes are NULL (not known), as are in_norm, out_norm and ratio.
-- param run: run name; empty (NULL) for every run
-- param rank: rank; empty (NULL) for every rank
-- param step: step number; empty (NULL) for every step
-- param module: qualified module name; the module and its submodules; empty (NULL) for all
WITH converters AS (  -- nodes whose DTensor shard on one side is this rank's plain local tensor on the other
    -- (DTensor.to_local / from_local under tensor parallelism: the plain side's shape is not the global one)
    SELECT DISTINCT td.step_id, td.node_id
    FROM tensor_shardings x
    JOIN shardings sh ON sh.id = x.sharding_id
    JOIN tensor_data td ON td.id = x.id
    JOIN tensors pl ON pl.step_id = td.step_id AND pl.node_id = td.node_id AND pl.role IN (0, 1) AND pl.role <> td.role
    LEFT JOIN tensor_shardings px ON px.id = pl.id
    WHERE td.role IN (0, 1) AND sh.placements LIKE '%Shard(%' AND px.id IS NULL AND pl.shape <> sh.global_shape
), pieces AS (  -- per step, the modules whose gradients on this rank include a piece: a DTensor with a Shard or
    -- Partial placement at one of their nodes, or a plain local shard across an edge from or to a converter
    SELECT td.step_id, n.module
    FROM tensor_shardings x
    JOIN shardings sh ON sh.id = x.sharding_id
    JOIN tensor_data td ON td.id = x.id
    JOIN nodes n ON n.id = td.node_id
    WHERE td.role IN (0, 1) AND (sh.placements LIKE '%Shard(%' OR sh.placements LIKE '%Partial(%')
    UNION
    SELECT c.step_id, n.module FROM converters c JOIN edges e ON e.src = c.node_id JOIN nodes n ON n.id = e.dst
    -- an edge that held in the converter's step (any edge where the step's graphs were not recorded)
    WHERE (EXISTS (SELECT 1 FROM passes p JOIN graph_edges ge ON ge.graph_id = p.graph_id
                  WHERE p.step_id = c.step_id AND ge.edge_id = e.id)
           OR NOT EXISTS (SELECT 1 FROM passes p WHERE p.step_id = c.step_id AND p.graph_id IS NOT NULL))
    UNION
    SELECT c.step_id, n.module FROM converters c JOIN edges e ON e.dst = c.node_id JOIN nodes n ON n.id = e.src
    WHERE (EXISTS (SELECT 1 FROM passes p JOIN graph_edges ge ON ge.graph_id = p.graph_id
                  WHERE p.step_id = c.step_id AND ge.edge_id = e.id)
           OR NOT EXISTS (SELECT 1 FROM passes p WHERE p.step_id = c.step_id AND p.graph_id IS NOT NULL))
), gains AS (
    SELECT mc.*,
           CASE WHEN EXISTS (SELECT 1 FROM pieces pc
                             WHERE pc.step_id = mc.step_id
                               AND (mc.module = '' OR pc.module = mc.module
                                    OR SUBSTR(pc.module, 1, LENGTH(mc.module) + 1) = mc.module || '.'))
                THEN 1 ELSE 0 END AS rank_local
    FROM module_calls mc
)
SELECT r.name AS run, st.rank, st.step, mc.call, mc.module, mc.ordinal, mc.first_seq, mc.in_norm, mc.out_norm,
       CASE WHEN mc.in_unmeasured = 0 AND mc.out_unmeasured = 0 AND mc.nonfinite = 0 AND mc.in_norm > 0
                 AND mc.rank_local = 0
            THEN mc.out_norm / mc.in_norm END AS ratio,
       CASE WHEN st.level = 'params' THEN 'not known: stats=''params'' walks no graph'
            WHEN mc.rank_local = 1
                 THEN 'not compared: the module''s gradients on this rank include DTensor pieces (Shard / Partial '
                      || 'placements: tensor parallelism); in_norm and out_norm are of this rank''s pieces or of whole '
                      || 'tensors, so out_norm / in_norm is not the gain, which no one rank''s rows give'
            WHEN mc.in_unmeasured > 0 OR mc.out_unmeasured > 0 THEN 'not measured: a boundary tensor has no statistics'
            -- a count above the unmeasured count with no norm: a gradient the pieces' norms do not give (findings)
            WHEN mc.out_norm IS NULL AND mc.out_tensors > mc.out_unmeasured
                 THEN 'not computed: an input of the call is also used outside it and by several ops inside it: the '
                      || 'gradient w.r.t. it is a sum of pieces whose norms do not give the norm of the sum'
            WHEN mc.in_norm IS NULL AND mc.in_tensors > mc.in_unmeasured
                 THEN 'not computed: an output of the call is also used inside it and by several ops outside it: the '
                      || 'gradient w.r.t. it is a sum of pieces whose norms do not give the norm of the sum'
            WHEN mc.nonfinite > 0 THEN 'NaN or Inf in a boundary tensor'
            WHEN mc.in_norm IS NULL OR mc.in_norm = 0 THEN 'nothing flowed in'
            WHEN mc.out_norm IS NULL THEN 'nothing flowed out (no input of the call needs a gradient)'
            END AS no_ratio,
       -- stats='params' walks no graph: which gradients crossed the call, and how many nodes it made, are not known
       CASE WHEN st.level = 'params' THEN NULL ELSE mc.in_tensors END AS in_tensors,
       CASE WHEN st.level = 'params' THEN NULL ELSE mc.out_tensors END AS out_tensors,
       CASE WHEN st.level = 'params' THEN NULL ELSE mc.in_unmeasured END AS in_unmeasured,
       CASE WHEN st.level = 'params' THEN NULL ELSE mc.out_unmeasured END AS out_unmeasured,
       CASE WHEN st.level = 'params' THEN NULL ELSE mc.nonfinite END AS nonfinite,
       CASE WHEN st.level = 'params' THEN NULL ELSE mc.nodes END AS nodes, mc.ran,
       mc.during_pass, mc.recomputes
FROM gains mc
JOIN steps st ON st.id = mc.step_id
JOIN runs r ON r.id = st.run_id
WHERE (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r.name = NULLIF(CAST(:run AS TEXT), ''))
  AND (CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER) IS NULL OR st.rank = CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER))
  AND (CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL OR st.step = CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER))
  AND (NULLIF(CAST(:module AS TEXT), '') IS NULL OR mc.module = NULLIF(CAST(:module AS TEXT), '')
       OR SUBSTR(mc.module, 1, LENGTH(NULLIF(CAST(:module AS TEXT), '')) + 1) = NULLIF(CAST(:module AS TEXT), '') || '.')
ORDER BY r.id, st.step, st.rank, CASE WHEN mc.first_seq IS NULL THEN 1 ELSE 0 END, mc.first_seq, mc.call;
