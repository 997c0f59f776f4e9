-- title: Backward passes
-- description: One row per backward pass: kind (backward accumulates into .grad; grad is torch.autograd.grad), flags, number of roots, inputs= and reachable nodes and node calls (NULL at stats='params', which walks no graph and hooks no node, and for a pass that compiled autograd ran, where gradstore hooks no node: not known; its root nodes' skipped grad_output rows say so), the parent pass and call of a nested pass (reentrant checkpoint), duration in seconds (from hook registration to the engine's return), and the recorder's own seconds on the training thread before the engine ran (setup: graph walk, keys, hooks) and after (finish: hook removal, parameter gradients, host transfer, rows); error: the exception the engine raised in the pass ('Type: message', also where the training code caught it; followed by ' [raised in a hook on the gradient of parameter NAME]' where a hook on a recorded parameter raised it while no node's call was open), NULL where it returned or where the pass was stored before schema revision 0010_pass_errors; raised_at: for a pass that raised, the key of the node whose call started and did not end (the node whose backward raised; the innermost, highest seq, where several did not end); where no call was left open and the error is anomaly mode's "Function 'NAME' returned nan values in its Nth output." (torch.autograd.detect_anomaly(check_nan=True) checks a call's grad_inputs right after it returned), the key of the pass's last call of a node named NAME; NULL where the pass returned or neither names a node (the engine raised outside a node, or stats='params', which hooks none); ddp_sync: for a top-level backward pass of models wrapped in DistributedDataParallel, 1 where DDP all-reduced the gradients, 0 where its gradient sync was off (the forward ran under no_sync(): each rank's .grad is its own accumulation), NULL without a DDP wrapper among the recorded models, for another kind of pass, or stored before schema revision 0015_ddp_sync; fsdp_sync: for a top-level backward pass of models with FSDP2 modules (fully_shard), 1 where every FSDP2 parameter group reduce-scattered its gradient into the sharded .grad after the pass, 0 where none did (set_requires_gradient_sync(False): the gradient accumulates inside FSDP2, not yet reduce-scattered into .grad, which stays None after zero_grad), 2 where some did and some did not, NULL without an FSDP2 module among the recorded models, for another kind of pass, or stored before schema revision 0016_fsdp_sync.
-- param run: run name; empty (NULL) for every run
-- param rank: rank; empty (NULL) for every rank
-- param step: step number; empty (NULL) for every step
SELECT r.name AS run, st.rank, st.step, p.pass, p.kind, p.parent_pass, p.parent_seq,
       p.create_graph, p.retain_graph, p.roots, p.inputs,
       CASE WHEN st.level = 'params' THEN NULL ELSE p.nodes END AS nodes,  -- stats='params' walks no graph: not counted
       CASE WHEN st.level = 'params' THEN NULL  -- no node hooked: not counted
            WHEN EXISTS (SELECT 1 FROM tensor_data t JOIN tensor_notes x ON x.id = t.id  -- compiled autograd: nor here
                         WHERE t.step_id = p.step_id AND t.status = 2 AND t.pass_id = p.id
                           AND x.reason LIKE 'compiled autograd ran this pass:%') THEN NULL
            ELSE (SELECT COUNT(*) FROM calls c WHERE c.id BETWEEN p.first_call AND p.last_call AND +c.pass_id = +p.id) END AS calls,
       p.started_at, p.duration, p.setup, p.finish, p.error,
       CASE WHEN p.error IS NOT NULL THEN
            COALESCE(
            (SELECT n.key FROM call_data c JOIN nodes n ON n.id = c.node_id
             WHERE c.id BETWEEN p.first_call AND p.last_call AND +c.pass_id = +p.id AND c.duration_ns IS NULL
             ORDER BY c.seq DESC LIMIT 1),
            -- anomaly mode's NaN check raises right after a call returned, naming its node: "Function 'NAME'
            -- returned nan values in its Nth output."; the pass's last call of a node named NAME is that call
            CASE WHEN p.error LIKE '%Function ''%'' returned nan values in its %' THEN
                 (SELECT n.key FROM call_data c JOIN nodes n ON n.id = c.node_id
                  WHERE c.id BETWEEN p.first_call AND p.last_call AND +c.pass_id = +p.id
                    AND p.error LIKE ('%Function ''' || n.name || ''' returned nan values in its %')
                  ORDER BY c.seq DESC LIMIT 1)
            END)
       END AS raised_at,
       p.ddp_sync,
       p.fsdp_sync
FROM passes p
JOIN steps st ON st.id = p.step_id
JOIN runs r ON r.id = st.run_id
WHERE (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r.name = NULLIF(CAST(:run AS TEXT), ''))
  AND (CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER) IS NULL OR st.rank = CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER))
  AND (CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL OR st.step = CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER))
ORDER BY r.id, st.step, st.rank, p.pass;
