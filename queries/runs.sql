-- title: Runs
-- description: Every recorded run with its status, world size, versions, number of recorded steps (all ranks; written ones), its last step written, and unwritten: the steps the writer could not write (a full disk, an I/O error; steps rows of status unwritten, all ranks), which a status of finished does not cover. The status is the aggregate over the run's ranks (queries/run_ranks.sql, one row per rank): running while any rank's writer is live (a scope open, its lease standing), else interrupted where a rank's process died (killed, out of memory, machine lost) with its scope open, else error where a rank's scope ended raising, else finished (every rank that recorded ended cleanly); a run with no claims row (recorded before revision 0013_rank_ends kept them, or merged from such files) shows its stored status, interrupted when that says running. finished_at is NULL while the run is running.
-- param run: run name; empty (NULL) for every run
-- param now: the current time in seconds since the epoch (gradstore binds it; Datasette's canned query q_runs reads it left empty as the current time): a rank whose scope is open is interrupted when its lease ran out at that time (heartbeat_at + lease < now); empty (NULL, as in the sqlite3 shell unbound) shows the stored status, which the writers keep as the aggregate (running, error, finished) but which cannot tell a dead writer from a live one. This SQL sees leases, not pids: a writer killed on this host reads as running here until its lease runs out (60 s after its last heartbeat, by default) unless dead names its claim, as store.runs() and gradstore runs do. (README: how to bind it in sqlite3)
-- param dead: claims ids (comma-separated) whose holder the reader found gone: gradstore binds the claims held on its own host whose pid is dead, which then read interrupted at once; empty (NULL): leases only (SQL cannot see a pid)
WITH prm AS (
    SELECT CASE WHEN CAST(:now AS TEXT) = '' THEN NULL ELSE CAST(:now AS DOUBLE PRECISION) END AS now,
           ',' || COALESCE(CAST(:dead AS TEXT), '') || ',' AS dead
), ranks AS (  -- each claimed rank's status, as queries/run_ranks.sql gives it
    SELECT c.run_id,
           CASE WHEN c.released_at IS NOT NULL THEN COALESCE(c.status, 'interrupted')
                WHEN prm.now IS NOT NULL AND (c.heartbeat_at + c.lease < prm.now
                                              OR prm.dead LIKE ('%,' || CAST(c.id AS TEXT) || ',%'))
                     THEN 'interrupted'
                ELSE COALESCE(c.status, 'running') END AS status
    FROM claims c CROSS JOIN prm
), agg AS (
    SELECT r.id,
           CASE WHEN prm.now IS NULL THEN r.status
                WHEN NOT EXISTS (SELECT 1 FROM ranks k WHERE k.run_id = r.id)
                     THEN CASE WHEN r.status = 'running' THEN 'interrupted' ELSE r.status END
                WHEN EXISTS (SELECT 1 FROM ranks k WHERE k.run_id = r.id AND k.status = 'running') THEN 'running'
                WHEN EXISTS (SELECT 1 FROM ranks k WHERE k.run_id = r.id AND k.status = 'interrupted') THEN 'interrupted'
                WHEN r.status = 'error' OR EXISTS (SELECT 1 FROM ranks k WHERE k.run_id = r.id AND k.status = 'error')
                     THEN 'error'
                ELSE 'finished' END AS status
    FROM runs r CROSS JOIN prm
)
SELECT r.name AS run,
       a.status,
       r.world_size, r.created_at,
       CASE WHEN a.status = 'running' THEN NULL ELSE r.finished_at END AS finished_at,
       r.torch_version, r.gradstore_version, r.host,
       (SELECT COUNT(*) FROM steps st WHERE st.run_id = r.id AND st.status <> 'unwritten') AS steps,
       (SELECT MAX(st.step) FROM steps st WHERE st.run_id = r.id AND st.status <> 'unwritten') AS last_step,
       (SELECT MAX(st.ended_at) FROM steps st WHERE st.run_id = r.id AND st.status <> 'unwritten') AS last_step_at,
       (SELECT MAX(c.heartbeat_at) FROM claims c WHERE c.run_id = r.id AND c.released_at IS NULL) AS heartbeat_at,
       (SELECT COUNT(*) FROM steps st WHERE st.run_id = r.id AND st.status = 'unwritten') AS unwritten
FROM runs r
JOIN agg a ON a.id = r.id
WHERE (NULLIF(CAST(:run AS TEXT), '') IS NULL OR r.name = NULLIF(CAST(:run AS TEXT), ''))
ORDER BY r.id;
