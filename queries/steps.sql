-- title: Steps
-- description: One row per recorded step and rank: timing (seconds), status (ok: nothing raised and every measured gradient finite / error: the step raised, or a backward pass in it raised and the training code caught it (error says which pass and what) / nonfinite / unmeasured: nothing raised and no gradient value was measured: stats level shape, or every gradient row skipped, as on the meta device or for a complex parameter, so finiteness is not known / unwritten: the writer could not write the step (a full disk, an I/O error): nothing of it is in the database but this row, whose error says why and what the step's status was), not_measured (the step's gradient rows, grad_output, grad_input and param_grad, and with record(forward=True) its activation and loss rows, that could not be measured: status skipped, the reason on each row, such as the module calls inside a torch.compile region, which run unseen; queries/not_measured.sql groups them by reason; 0 at stats level shape, which measures none and skips none; NULL for an unwritten step, whose rows are not stored), error text, number of backward passes, the backward passes torch.compile ran while tracing (not recorded), optimizer_steps (the optimizer step() calls that returned in the step on the recording thread; 0: no optimizer stepped, as in a step the loop skipped, a hand-written update or a GradScaler that skipped it, so the step's final param_grad rows are the .grad the step ended with, or that zero_grad cleared, not one an optimizer read; NULL for a step recorded before schema revision 0014_optimizer_steps: not known), the stats level, rows dropped (on_full='drop') and seconds waited for the writer (on_full='wait'); with record(values=...), values_bytes (bytes of gradient elements stored) and values_left_out (matching gradients whose elements the step's byte budget left out), NULL without it.
-- param run: run name; empty (NULL) for every run
-- param rank: rank; empty (NULL) for every rank
-- param step: step number; empty (NULL) for every step
SELECT r.name AS run, st.rank, st.step,
       CASE WHEN st.status = 'ok' AND st.level = 'shape' THEN 'unmeasured'
            -- nothing measured: some gradient row skipped (a partial index holds those) and none measured
            WHEN st.status = 'ok'
                 AND EXISTS (SELECT 1 FROM tensor_data t WHERE t.step_id = st.id AND t.status = 2 AND t.role IN (0, 1, 2))
                 AND NOT EXISTS (SELECT 1 FROM tensor_data t WHERE t.step_id = st.id AND t.status = 0 AND t.role IN (0, 1, 2))
            THEN 'unmeasured'
            ELSE st.status END AS status,
       CASE WHEN st.status <> 'unwritten'  -- an unwritten step's rows are not stored: nothing is known of them
            THEN (SELECT COUNT(*) FROM tensor_data t WHERE t.step_id = st.id AND t.status = 2 AND t.role IN (0, 1, 2, 4, 5))
       END AS not_measured,
       st.passes, st.tracing_passes, st.optimizer_steps, st.level, st.dropped, st.waited,
       st.values_bytes, st.values_left_out,
       st.started_at, st.ended_at, st.ended_at - st.started_at AS duration, st.error
FROM steps st
JOIN runs r ON r.id = st.run_id
WHERE (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r.name = NULLIF(CAST(:run AS TEXT), ''))
  AND (CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER) IS NULL OR st.rank = CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER))
  AND (CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL OR st.step = CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER))
ORDER BY r.id, st.step, st.rank;
