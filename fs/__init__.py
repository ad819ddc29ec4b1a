"""Filesystem core: FUSE operations, inode table, RAM cache, backing layout, flusher."""
