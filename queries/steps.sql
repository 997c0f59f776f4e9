-- title: Steps
-- description: One row per recorded step and rank: timing (seconds), status (ok / error / nonfinite, or unmeasured: stats level shape, which measures no value, where nothing raised), error text, number of backward passes, the backward passes torch.compile ran while tracing (not recorded), the stats level, rows dropped (on_full='drop') and seconds waited for the writer (on_full='wait'); with record(values=...), values_bytes (bytes of gradient elements stored) and values_left_out (matching gradients whose elements the step's byte budget left out), NULL without it.
-- param run: run name; empty (NULL) for every run
-- param rank: rank; empty (NULL) for every rank
-- param step: step number; empty (NULL) for every step
SELECT r.name AS run, st.rank, st.step,
       CASE WHEN st.status = 'ok' AND st.level = 'shape' THEN 'unmeasured' ELSE st.status END AS status, st.passes, st.tracing_passes, st.level, st.dropped, st.waited,
       st.values_bytes, st.values_left_out,
       st.started_at, st.ended_at, st.ended_at - st.started_at AS duration, st.error
FROM steps st
JOIN runs r ON r.id = st.run_id
WHERE (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r.name = NULLIF(CAST(:run AS TEXT), ''))
  AND (CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER) IS NULL OR st.rank = CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER))
  AND (CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER) IS NULL OR st.step = CAST(NULLIF(CAST(:step AS TEXT), '') AS INTEGER))
ORDER BY r.id, st.step, st.rank;
