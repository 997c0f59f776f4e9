-- title: First non-finite gradient (and forward activation or loss)
-- description: Per run and rank, in execution order (step, then seq across the step's passes; a call's grad_inputs count at its end, after the calls of passes nested in it, as a reentrant checkpoint's), the first call whose grad_outputs or grad_inputs (gradients only: saved tensors are first_nonfinite_saved's) hold NaN or +/-Inf: one row per non-finite gradient slot of that call (phase backward), with node, module, the user-code frame that created the node (record(frames=True), else NULL), step, pass, role and slot. With record(forward=True), before those rows, the first event of the forward side whose tensors hold NaN or +/-Inf, when it comes before that call (or there is no such call), in a step whose gradients or loss also held one (a module output alone, such as an additive -inf attention mask, is a forward value, not a fault: Store.activations lists it): a module call's outputs (role activation, key module/forward#k, pass NULL) or a pass's loss (role loss, the root's node key, its pass), one row per non-finite slot (phase forward; seq from the step's counter shared with the backward calls). Where no call's gradients held one before, a parameter's gradient does (a `.grad` measured with NaN or +/-Inf at a pass's end, or in the step's final rows, as at stats='params', which records no calls): the first such param_grad row (phase backward, seq NULL; pass NULL for a final row), ordered after the calls of its step, by pass (the final rows last), then in the order the parameters' AccumulateGrad nodes ran (in that pass; for a final row, in the step), then in the order its rows were written (at stats='params', which records no AccumulateGrad call, that order says nothing of which went non-finite first).
-- param run: run name; empty (NULL) for every run
-- param rank: rank; empty (NULL) for every rank
-- param step: step number; empty (NULL) for every step
-- param faults: any text (1) leaves out the steps in which a torch.amp.GradScaler skipped the optimizer step for what can be an overflow of its loss scale, which it handles itself (step value grad_scaler.fault = 0), so that the first row is of a step that is a fault (a skip that cannot be an overflow, grad_scaler.fault 1 to 3, or no skip); empty (NULL) for every step
-- param role: grad_output, grad_input, param_grad, activation or loss (only rows of that role); empty (NULL) for all five
WITH bad AS (  -- seq: when the row's values were there: a call's grad_outputs at its start, its grad_inputs at its
    -- end, which for a call that ran nested passes (a reentrant checkpoint's recomputation and backward) comes after
    -- their calls (and those of passes nested in them): half past the last of those
    SELECT st.run_id, st.rank, st.step,
           CASE WHEN t.role = 1 AND EXISTS (SELECT 1 FROM passes p2 WHERE p2.step_id = t.step_id
                                            AND p2.parent_pass = pc.pass AND p2.parent_seq = c.seq)
                THEN 0.5 + (SELECT MAX(x.seq) FROM (
                         SELECT c2.seq FROM passes p2 JOIN call_data c2 ON c2.pass_id = p2.id
                         WHERE p2.step_id = t.step_id AND p2.parent_pass = pc.pass AND p2.parent_seq = c.seq
                         UNION ALL
                         SELECT c3.seq FROM passes p2 JOIN call_data c2 ON c2.pass_id = p2.id
                         JOIN passes p3 ON p3.step_id = p2.step_id AND p3.parent_pass = p2.pass AND p3.parent_seq = c2.seq
                         JOIN call_data c3 ON c3.pass_id = p3.id
                         WHERE p2.step_id = t.step_id AND p2.parent_pass = pc.pass AND p2.parent_seq = c.seq) x)
                ELSE c.seq END AS seq,
           t.call_id
    FROM tensors t
    JOIN calls c ON c.id = t.call_id
    JOIN passes pc ON pc.id = c.pass_id
    JOIN steps st ON st.id = t.step_id
    JOIN runs r ON r.id = st.run_id
    JOIN roles ro ON ro.id = t.role
    WHERE t.nan + t.posinf + t.neginf > 0
      AND t.call_id IS NOT NULL
      AND t.role IN (0, 1)  -- gradients: grad_output, grad_input
      AND (NULLIF(CAST(:role AS TEXT), '') IS NULL OR ro.name = NULLIF(CAST(:role AS TEXT), ''))
      AND (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r.name = NULLIF(CAST(:run AS TEXT), ''))
      AND (CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER) IS NULL OR st.rank = CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER))
      AND (CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL OR st.step = CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER))
      AND (NULLIF(CAST(:faults AS TEXT), '') IS NULL OR NOT EXISTS (  -- a GradScaler skip it handled: left out
               SELECT 1 FROM step_values v WHERE v.step_id = st.id AND v.name = 'grad_scaler.fault' AND v.value = 0))
), pbad AS (  -- parameters' gradients (a pass's param_grad rows, the step's final rows): after the step's calls;
    -- among them, in the order their AccumulateGrad nodes ran (in that pass; for a final row, in the step)
    SELECT st.run_id, st.rank, st.step, t.step_id, t.node_id, t.id AS tid, COALESCE(p.pass, 2147483647) AS pass_order,
           COALESCE((SELECT MIN(c.seq) FROM passes p2
                     JOIN call_data c ON c.id BETWEEN p2.first_call AND p2.last_call AND +c.pass_id = +p2.id
                     WHERE p2.step_id = t.step_id AND (p.id IS NULL OR p2.id = p.id) AND c.node_id = t.node_id),
                    2147483647) AS acc_seq
    FROM tensors t
    JOIN steps st ON st.id = t.step_id
    JOIN runs r ON r.id = st.run_id
    JOIN roles ro ON ro.id = t.role
    LEFT JOIN passes p ON p.id = t.pass_id
    WHERE t.nan + t.posinf + t.neginf > 0
      AND t.role = 2  -- param_grad
      AND (NULLIF(CAST(:role AS TEXT), '') IS NULL OR ro.name = NULLIF(CAST(:role AS TEXT), ''))
      AND (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r.name = NULLIF(CAST(:run AS TEXT), ''))
      AND (CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER) IS NULL OR st.rank = CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER))
      AND (CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL OR st.step = CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER))
      AND (NULLIF(CAST(:faults AS TEXT), '') IS NULL OR NOT EXISTS (  -- a GradScaler skip it handled: left out
               SELECT 1 FROM step_values v WHERE v.step_id = st.id AND v.name = 'grad_scaler.fault' AND v.value = 0))
), ranked AS (  -- calls (kind 0, by seq) before parameters' gradients (kind 1) in a step
    SELECT run_id, rank, step, seq, call_id, step_id, node_id, tid,
           ROW_NUMBER() OVER (PARTITION BY run_id, rank ORDER BY step, kind, seq, pass_order, acc_seq, tid) AS nth
    FROM (SELECT run_id, rank, step, 0 AS kind, seq, 0 AS pass_order, 0 AS acc_seq, call_id, NULL AS step_id,
                 NULL AS node_id, NULL AS tid
          FROM bad
          UNION ALL
          SELECT run_id, rank, step, 1, NULL, pass_order, acc_seq, NULL, step_id, node_id, tid FROM pbad) u
), fbad AS (  -- record(forward=True): non-finite activations and losses
    SELECT st.run_id, st.rank, st.step, a.seq, t.id AS tid, t.node_id, t.pass_id, t.role, t.slot, t.numel, t.nan,
           t.posinf, t.neginf, t.norm, t.min, t.max
    FROM tensors t
    JOIN forward_seqs a ON a.id = t.id
    JOIN steps st ON st.id = t.step_id
    JOIN runs r ON r.id = st.run_id
    JOIN roles ro ON ro.id = t.role
    WHERE t.nan + t.posinf + t.neginf > 0
      AND t.role IN (4, 5)  -- activation, loss
      -- a module's output counts where the step's gradients (or a loss) went non-finite too: alone it is a forward
      -- value (an additive -inf mask), as a saved tensor is, and no fault (Store.activations lists it)
      AND (t.role = 5 OR EXISTS (SELECT 1 FROM tensors g WHERE g.step_id = t.step_id AND g.role IN (0, 1, 2, 5)
                                 AND g.nan + g.posinf + g.neginf > 0))
      AND (NULLIF(CAST(:role AS TEXT), '') IS NULL OR ro.name = NULLIF(CAST(:role AS TEXT), ''))
      AND (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r.name = NULLIF(CAST(:run AS TEXT), ''))
      AND (CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER) IS NULL OR st.rank = CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER))
      AND (CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL OR st.step = CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER))
      AND (NULLIF(CAST(:faults AS TEXT), '') IS NULL OR NOT EXISTS (  -- a GradScaler skip it handled: left out
               SELECT 1 FROM step_values v WHERE v.step_id = st.id AND v.name = 'grad_scaler.fault' AND v.value = 0))
), ffirst AS (  -- the first module call with one, where it comes before the first non-finite backward call
    SELECT f.run_id, f.rank, f.step, f.seq
    FROM (SELECT run_id, rank, step, seq, ROW_NUMBER() OVER (PARTITION BY run_id, rank ORDER BY step, seq) AS nth
          FROM fbad) f
    LEFT JOIN ranked b ON b.run_id = f.run_id AND b.rank = f.rank AND b.nth = 1
    WHERE f.nth = 1 AND (b.step IS NULL OR f.step < b.step OR (f.step = b.step AND (b.seq IS NULL OR f.seq < b.seq)))
), found AS (
    SELECT r.id AS o_run, 0 AS o_phase, t.role AS o_role,
           r.name AS run, st.rank, st.step, p.pass, c.seq, n.key, n.name, n.module, n.frame,
           ro.name AS role, t.slot, t.numel, t.nan, t.posinf, t.neginf, t.norm, t.min, t.max, 'backward' AS phase
    FROM ranked
    JOIN calls c ON c.id = ranked.call_id
    JOIN tensors t ON t.step_id = c.step_id AND t.node_id = c.node_id AND t.call_id = c.id
    JOIN passes p ON p.id = c.pass_id
    JOIN steps st ON st.id = c.step_id
    JOIN runs r ON r.id = st.run_id
    JOIN nodes n ON n.id = c.node_id
    JOIN roles ro ON ro.id = t.role
    WHERE ranked.nth = 1 AND t.nan + t.posinf + t.neginf > 0 AND t.role IN (0, 1)
      AND (NULLIF(CAST(:role AS TEXT), '') IS NULL OR ro.name = NULLIF(CAST(:role AS TEXT), ''))
    UNION ALL
    SELECT r.id, 0, t.role, r.name, st.rank, st.step, p.pass, NULL, n.key, n.name, n.module, n.frame,
           ro.name, t.slot, t.numel, t.nan, t.posinf, t.neginf, t.norm, t.min, t.max, 'backward'
    FROM ranked
    JOIN tensors t ON t.step_id = ranked.step_id AND t.node_id = ranked.node_id AND t.id = ranked.tid
    JOIN steps st ON st.id = t.step_id
    JOIN runs r ON r.id = st.run_id
    JOIN nodes n ON n.id = t.node_id
    JOIN roles ro ON ro.id = t.role
    LEFT JOIN passes p ON p.id = t.pass_id
    WHERE ranked.nth = 1 AND ranked.tid IS NOT NULL
    UNION ALL
    SELECT r.id, -1, f.role, r.name, f.rank, f.step, p.pass, f.seq, n.key, n.name, n.module, n.frame,
           ro.name, f.slot, f.numel, f.nan, f.posinf, f.neginf, f.norm, f.min, f.max, 'forward'
    FROM ffirst
    JOIN fbad f ON f.run_id = ffirst.run_id AND f.rank = ffirst.rank AND f.step = ffirst.step AND f.seq = ffirst.seq
    JOIN runs r ON r.id = f.run_id
    JOIN nodes n ON n.id = f.node_id
    JOIN roles ro ON ro.id = f.role
    LEFT JOIN passes p ON p.id = f.pass_id
)
SELECT run, rank, step, pass, seq, key, name, module, frame, role, slot, numel, nan, posinf, neginf, norm, min, max,
       phase
FROM found
ORDER BY o_run, rank, o_phase, o_role, slot;
