"""Small pieces of infrastructure every layer may use, each written once: the retry policy
(``retry``), the background worker thread (``worker``) and the option declaration
(``options``: ``Opt`` fields and what is derived from them). They import nothing of
speedtronic."""
