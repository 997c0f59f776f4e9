"""The database side: schema and codes, engines and Alembic revisions, the writer thread, named queries, the
`Store` reader and merge. Nothing here imports the hot path (gradstore.recording); what a recording hands
over arrives as the plain data of gradstore.records.
"""
