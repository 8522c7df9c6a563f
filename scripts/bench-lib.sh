# Shared by the server benchmark scripts (sourced, not run): loopback ports.

# A port nothing listens on, on 127.0.0.1.
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# Waits (up to 30 s) until something listens on 127.0.0.1:PORT.
wait_port() {
  for _ in $(seq 1 300); do
    (echo > "/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.1
  done
  echo "nothing listens on 127.0.0.1:$1" >&2
  return 1
}
