-- title: Flight-recorder dumps
-- description: One row per dump of a flight recorder (record(keep=N)): the step whose trigger fired, the reason (nonfinite: a NaN/Inf gradient; spike: the total gradient norm above spike_factor times its running median; error: the step raised; manual: rec.dump()), the steps written in full (first_step to last_step of that rank) and when (seconds since the epoch); unwritten: how many of those steps the writer could not write in full (a full disk, an I/O error: steps rows of status unwritten, or a summary kept whose detail was not written, its error starting 'detail not written'; the error says why): the dump was made, but those steps' rows are not in the record (0 where every one was written).
-- param run: run name; empty (NULL) for every run
-- param rank: rank; empty (NULL) for every rank
SELECT r.name AS run, d.rank, d.step, d.reason, d.first_step, d.last_step, d.at,
       (SELECT COUNT(*) FROM steps st WHERE st.run_id = d.run_id AND st.rank = d.rank AND st.step BETWEEN d.first_step AND d.last_step
                                       AND (st.status = 'unwritten' OR st.error LIKE 'detail not written to the database%'
                                            OR st.error LIKE '%; detail not written to the database%')) AS unwritten
FROM dumps d
JOIN runs r ON r.id = d.run_id
WHERE (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r.name = NULLIF(CAST(:run AS TEXT), ''))
  AND (CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER) IS NULL OR d.rank = CAST(NULLIF(CAST(:rank AS TEXT), '') AS INTEGER))
ORDER BY r.id, d.rank, d.step, d.id;
