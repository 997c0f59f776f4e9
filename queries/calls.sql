-- title: Calls
-- description: Every node execution, in execution order (seq counts across all passes of a step): start in seconds since its pass began, duration in seconds (both stored as whole nanoseconds), and sequence_nr, the node's autograd sequence number (grad_fn._sequence_nr(), torch.profiler's "Sequence number"; NULL for AccumulateGrad, which has none of its own, and for calls stored before schema revision 0011_sequence_nr).
-- param run: run name; empty (NULL) for every run
-- param rank: rank; empty (NULL) for every rank
-- param step: step number; empty (NULL) for every step
-- param module: qualified module name; the module and its submodules; empty (NULL) for all
SELECT r.name AS run, st.rank, st.step, p.pass, c.seq, n.key, n.name, n.module, n.param,
       c.start, c.duration, c.sequence_nr
FROM runs r
JOIN steps st ON st.run_id = r.id
JOIN passes p ON p.step_id = st.id
-- the matching steps' passes first, then each pass's calls: the id range first_call..last_call (unary + keeps
-- SQLite's planner on that range)
JOIN calls c ON c.id BETWEEN p.first_call AND p.last_call AND +c.pass_id = +p.id
JOIN nodes n ON n.id = c.node_id
WHERE (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r.name = NULLIF(CAST(:run AS TEXT), ''))
  AND (CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER) IS NULL OR st.rank = CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER))
  AND (CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL OR st.step = CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER))
  AND (NULLIF(CAST(:module AS TEXT), '') IS NULL OR n.module = NULLIF(CAST(:module AS TEXT), '')
       OR SUBSTR(n.module, 1, LENGTH(NULLIF(CAST(:module AS TEXT), '')) + 1) = NULLIF(CAST(:module AS TEXT), '') || '.')
ORDER BY r.id, st.step, st.rank, c.seq;
