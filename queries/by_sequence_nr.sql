-- title: Node by sequence number
-- description: Which node, and so which module (layer), has autograd sequence number sequence_nr in a step: its calls with the node's key, name, kind, owning module ('' outside any module), parameter, the user-code frame that created it (record(frames=True)) and a compiled region's modules. The number is grad_fn._sequence_nr(), what torch.profiler's backward events call "Sequence number" (AddmmBackward0 #317). A thread's counter runs from the process start and grows step after step, and each rank's process counts on its own: name the step and the rank. Only calls carry it: a node the step walked that did not run, or that modules=/params= left unhooked, is not found, nor is a call stored before schema revision 0011_sequence_nr; an AccumulateGrad node has no number of its own (torch gives every one 2**64-1: NULL, never matched): find it by its parameter (param:NAME).
-- param run: run name; empty (NULL) for every run
-- param rank: rank; empty (NULL) for every rank
-- param step: step number; empty (NULL) for every step
-- param sequence_nr: the node's autograd sequence number; empty (NULL) for every call that has one
SELECT r.name AS run, st.rank, st.step, p.pass, c.seq, c.sequence_nr, n.key, n.name, k.name AS kind, n.module,
       n.param, n.frame, n.region
FROM runs r
JOIN steps st ON st.run_id = r.id
JOIN passes p ON p.step_id = st.id
-- each matching step's calls: its passes' id ranges first_call..last_call (unary + keeps SQLite on the range)
JOIN calls c ON c.id BETWEEN p.first_call AND p.last_call AND +c.pass_id = +p.id
JOIN nodes n ON n.id = c.node_id
JOIN kinds k ON k.id = n.kind
WHERE (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r.name = NULLIF(CAST(:run AS TEXT), ''))
  AND (CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER) IS NULL OR st.rank = CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER))
  AND (CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL OR st.step = CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER))
  AND c.sequence_nr IS NOT NULL
  AND (CAST(NULLIF(CAST(:sequence_nr AS TEXT), '') AS BIGINT) IS NULL
       OR c.sequence_nr = CAST(NULLIF(CAST(:sequence_nr AS TEXT), '') AS BIGINT))
ORDER BY r.id, st.step, st.rank, c.seq;
