-- title: Edges
-- description: The graph: slot src_slot of src's grad_inputs flows into slot dst_slot of dst's grad_outputs (node.next_functions[src_slot] == (dst, dst_slot)).
-- param run: run name; empty (NULL) for every run
SELECT r.name AS run, a.key AS src, e.src_slot, b.key AS dst, e.dst_slot, e.first_step
FROM edges e
JOIN runs r ON r.id = e.run_id
JOIN nodes a ON a.id = e.src
JOIN nodes b ON b.id = e.dst
WHERE (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r.name = NULLIF(CAST(:run AS TEXT), ''))
ORDER BY r.id, e.id;
