-- title: Edges
-- description: The graph: slot src_slot of src's grad_inputs flows into slot dst_slot of dst's grad_outputs (node.next_functions[src_slot] == (dst, dst_slot)); first_step: the first step whose backward passes walked it. Without a step: every edge of the run, the union over its steps (a graph whose structure changes between steps, by data-dependent control flow or a recompiled torch.compile region, has edges that never held together; held NULL). With a step: the edges of the graphs that step's passes walked (on that rank; on any rank without one), held 'yes'; where none of the step's passes has its graph recorded (stored before schema revision 0012_edge_steps, or stats='params', which walks no graph) which edges held in it is not known: every edge first walked by that step, held 'not recorded per step'.
-- param run: run name; empty (NULL) for every run
-- param step: step number: the edges that held in that step; empty (NULL) for every edge (the union over steps)
-- param rank: with a step, that rank's passes; empty (NULL) for every rank
WITH asked AS (  -- the step asked for, per run and rank (none without a step)
    SELECT st.id, st.run_id
    FROM steps st
    WHERE st.step = CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER)
      AND (CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER) IS NULL OR st.rank = CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER))
), known AS (  -- the runs whose asked step has a pass with its graph recorded
    SELECT DISTINCT a.run_id FROM asked a JOIN passes p ON p.step_id = a.id WHERE p.graph_id IS NOT NULL
), held AS (  -- the edges of those passes' graphs
    SELECT DISTINCT ge.edge_id FROM asked a JOIN passes p ON p.step_id = a.id JOIN graph_edges ge ON ge.graph_id = p.graph_id
)
SELECT r.name AS run, a.key AS src, e.src_slot, b.key AS dst, e.dst_slot, e.first_step,
       CASE WHEN CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL THEN NULL
            WHEN e.run_id IN (SELECT run_id FROM known) THEN 'yes'
            ELSE 'not recorded per step' END AS held
FROM edges e
JOIN runs r ON r.id = e.run_id
JOIN nodes a ON a.id = e.src
JOIN nodes b ON b.id = e.dst
WHERE (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r.name = NULLIF(CAST(:run AS TEXT), ''))
  AND (CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL
       OR e.id IN (SELECT edge_id FROM held)
       OR (e.run_id NOT IN (SELECT run_id FROM known) AND e.run_id IN (SELECT run_id FROM asked)
           AND e.first_step <= CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER)))
ORDER BY r.id, e.id;
