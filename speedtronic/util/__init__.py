"""Small pieces of infrastructure every layer may use, each written once: the retry policy
(``retry``) and the background worker thread (``worker``). They import nothing of
speedtronic."""
