"""I/O adapters: the fleet and config kept in Redis (``store``) and the in-flight load stores
(``loads``: in process, or shared through Redis)."""
