-- title: Ranks of runs: who recorded each rank and how its recording stands or ended
-- description: One row per rank of a run that recorded into this database (its claims row, and any rank with steps here), with status running (its writer is live: a scope is open, its heartbeat is within its lease and, as gradstore also checks on the writer's host, its pid is alive), finished (its scope ended cleanly), error (its scope ended raising: ended_step is the step, error the exception), interrupted (its process died, or ended, with its scope open: pid and host name it, heartbeat_at is its last sign of life; the steps it had not yet written are lost), or NULL (the rank wrote steps here but has no claims row: recorded before revision 0013_rank_ends, or merged from such a file: how it ended is not known; the run's stored status covers it); a decorator's process between calls keeps the status of its last call. pid, host, claimed_at (when it claimed the rank), heartbeat_at, lease, ended_at, ended_step, error, released_at (when it gave the claim back); steps (its steps written), last_step (its highest step number written), last_step_at (when it ended), unwritten (its steps rows of status unwritten). The run's status (queries/runs.sql) is the aggregate of these: running if any rank is running, else interrupted if any is, else error if any is, else finished.
-- param run: run name; empty (NULL) for every run
-- param now: the current time in seconds since the epoch (gradstore binds it; Datasette's canned query reads it left empty as the current time): a rank whose scope is open is interrupted when its lease ran out at that time (heartbeat_at + lease < now); empty (NULL, as in the sqlite3 shell unbound) judges no lease: every open scope reads running
-- param dead: claims ids (comma-separated) whose holder the reader found gone: gradstore binds the claims held on its own host whose pid is dead, which then read interrupted at once; empty (NULL): leases only (SQL cannot see a pid)
WITH prm AS (
    SELECT CASE WHEN CAST(:now AS TEXT) = '' THEN NULL ELSE CAST(:now AS DOUBLE PRECISION) END AS now,
           ',' || COALESCE(CAST(:dead AS TEXT), '') || ',' AS dead
), k AS (  -- every rank that claimed, or wrote a step of, a run
    SELECT run_id, rank FROM claims
    UNION
    SELECT run_id, rank FROM steps
)
SELECT r.name AS run,
       k.rank,
       CASE WHEN c.id IS NULL THEN NULL
            WHEN c.released_at IS NOT NULL THEN COALESCE(c.status, 'interrupted')
            WHEN prm.now IS NOT NULL AND (c.heartbeat_at + c.lease < prm.now
                                          OR prm.dead LIKE ('%,' || CAST(c.id AS TEXT) || ',%'))
                 THEN 'interrupted'
            ELSE COALESCE(c.status, 'running') END AS status,
       c.pid,
       c.host,
       c.started_at AS claimed_at,
       c.heartbeat_at,
       c.lease,
       c.ended_at,
       c.ended_step,
       c.error,
       c.released_at,
       (SELECT COUNT(*) FROM steps st WHERE st.run_id = k.run_id AND st.rank = k.rank AND st.status <> 'unwritten') AS steps,
       (SELECT MAX(st.step) FROM steps st WHERE st.run_id = k.run_id AND st.rank = k.rank AND st.status <> 'unwritten') AS last_step,
       (SELECT MAX(st.ended_at) FROM steps st WHERE st.run_id = k.run_id AND st.rank = k.rank AND st.status <> 'unwritten') AS last_step_at,
       (SELECT COUNT(*) FROM steps st WHERE st.run_id = k.run_id AND st.rank = k.rank AND st.status = 'unwritten') AS unwritten
FROM k
JOIN runs r ON r.id = k.run_id
LEFT JOIN claims c ON c.run_id = k.run_id AND c.rank = k.rank
CROSS JOIN prm
WHERE (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r.name = NULLIF(CAST(:run AS TEXT), ''))
ORDER BY r.id, k.rank;
