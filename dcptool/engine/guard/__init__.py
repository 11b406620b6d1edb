"""The Guard: each observation checked as it is made (numpy on the host, a kernel on the device), the last `keep`
dumped on the first wrong one."""
