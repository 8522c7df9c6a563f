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

# Exits unless every argument is an executable (the release build comes first).
need_built() {
  for b in "$@"; do
    [ -x "$b" ] || { echo "build first: $b is missing" >&2; exit 2; }
  done
}

# Starts `$probity serve` on $work/NAME.toml (its log in $work/NAME.log), remembers its
# PID in pids (for the caller's cleanup) and in server_pid, and waits for PORT.
start_server() {
  "$probity" serve --config "$work/$1.toml" > "$work/$1.log" 2>&1 &
  server_pid=$!
  pids+=("$server_pid")
  wait_port "$2"
}

# Stops the server start_server started, by its PID, and waits for it.
stop_server() {
  kill -TERM "$server_pid"
  wait "$server_pid" 2>/dev/null || true
}
