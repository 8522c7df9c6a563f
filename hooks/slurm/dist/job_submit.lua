--[[
Probity's job_submit.lua: every job is admitted by Probity's policies at submission,
with the rules Kubernetes admission applies (the inference partition's CPU:GPU ratio,
RL-HF work only in its partitions or node set, unknown workload classes refused).

Install: next to slurm.conf (JobSubmitPlugins=lua), with Debian's lua-posix.

How it asks: it runs `probity slurm submit FIELD=VALUE...` by fork and exec, with no
shell: each field is one argv entry, so nothing a user types is quoted, parsed or
built into JSON here. Probity answers one line, `allow<TAB><submission><TAB><warnings>`
or `deny<TAB><message><TAB>`. How the fields become the policies' Workload (which field names
the namespace, where the class comes from, which GRES counts as GPUs) is the
sidecar's `[slurm]` configuration, not this file.

It runs inside slurmctld, under its locks: the whole question is bounded (Probity's
own deadline, then a hard kill of its process group), and when Probity cannot answer
in time the job is refused (ON_ERROR = "refuse", fail closed) unless the operator chose
"allow". The answer's submission token is kept in the job's admin comment
(`probity:<token>`, which only an operator can set) and appended to its comment (which
the Prolog's environment carries; a user's own `probity:` words are dropped and their
later changes refused), so the Prolog can find the facts judged at submission.

Each setting below can be overridden from slurmctld's environment.
]]

local PROBITY = os.getenv("PROBITY_BIN") or "/usr/bin/probity"
local SOCKET = os.getenv("PROBITY_SOCKET") or "/run/probity/probity.sock"
-- Probity's own deadline; the process is killed 500 ms after it.
local TIMEOUT_MS = tonumber(os.getenv("PROBITY_TIMEOUT_MS") or "") or 1500
-- "refuse" (fail closed) or "allow" when Probity cannot answer.
local ON_ERROR = os.getenv("PROBITY_ON_ERROR") or "refuse"

local unistd = require "posix.unistd"
local pwait = require "posix.sys.wait"
local psignal = require "posix.signal"
local ptime = require "posix.time"
local ppoll = require "posix.poll"

-- The job fields Probity reads. `gres` is only the older spelling of tres_per_node.
local FIELDS = {
  "partition", "account", "qos", "comment", "name", "user_id", "group_id",
  "tres_per_node", "tres_per_job", "tres_per_task", "tres_per_socket",
  "min_nodes", "num_tasks", "cpus_per_task", "min_cpus", "features", "req_nodes",
}

local function now_ms()
  local t = ptime.clock_gettime(ptime.CLOCK_MONOTONIC)
  return t.tv_sec * 1000 + math.floor(t.tv_nsec / 1000000)
end

-- Runs argv (no shell) with a hard deadline; returns how it ended ("exited",
-- "killed", "timeout", "error"), its exit code and its standard output.
local function run(argv, limit_ms)
  local limit = now_ms() + limit_ms
  local r, w = unistd.pipe()
  if not r then return "error", 0, "pipe: " .. tostring(w) end
  local pid, err = unistd.fork()
  if pid == nil then
    unistd.close(r); unistd.close(w)
    return "error", 0, "fork: " .. tostring(err)
  end
  if pid == 0 then
    -- The child: its own process group (so a timeout kills all of it), stdout to
    -- the pipe, then exec. glibc makes malloc safe between fork and exec.
    unistd.setpid("p", 0, 0)
    unistd.close(r)
    unistd.dup2(w, 1)
    unistd.close(w)
    local args = {}
    for i = 2, #argv do args[i - 1] = argv[i] end
    unistd.execp(argv[1], args)
    unistd._exit(127)
  end
  unistd.close(w)
  local chunks = {}
  while true do
    local left = limit - now_ms()
    if left <= 0 then break end
    if ppoll.rpoll(r, left) == 1 then
      local data = unistd.read(r, 4096)
      if data == nil or data == "" then break end
      chunks[#chunks + 1] = data
    end
  end
  unistd.close(r)
  while true do
    -- WNOHANG answers 0 while the child runs: compare the pid.
    local wpid, kind, code = pwait.wait(pid, pwait.WNOHANG)
    if wpid == pid then return kind, code, table.concat(chunks) end
    if wpid == nil then return "error", 0, "wait: " .. tostring(kind) end
    if now_ms() >= limit then
      psignal.kill(-pid, psignal.SIGKILL)
      pwait.wait(pid)
      return "timeout", 0, table.concat(chunks)
    end
    ptime.nanosleep({ tv_sec = 0, tv_nsec = 5000000 })
  end
end

local function refuse(message)
  slurm.log_user("%s", message)
  return slurm.ESLURM_ACCESS_DENIED
end

local function undecided(why)
  slurm.log_info("probity: %s", why)
  if ON_ERROR == "allow" then
    return slurm.SUCCESS
  end
  return refuse("Probity could not decide (" .. why .. "): refused")
end

-- The partition a job without `-p` goes to: the one slurm.conf marks Default=YES.
local function default_partition(part_list)
  for _, part in pairs(part_list or {}) do
    if part.flag_default == 1 then
      return part.name
    end
  end
  return nil
end

function slurm_job_submit(job_desc, part_list, submit_uid)
  local argv = {
    PROBITY, "slurm", "submit",
    "--socket", SOCKET,
    "--timeout-ms", tostring(TIMEOUT_MS),
    "--on-error", ON_ERROR,
  }
  for _, name in ipairs(FIELDS) do
    local value = job_desc[name]
    if value == nil and name == "tres_per_node" then value = job_desc.gres end
    if value == nil and name == "partition" then value = default_partition(part_list) end
    if value ~= nil then
      argv[#argv + 1] = name .. "=" .. tostring(value)
    end
  end
  local kind, code, out = run(argv, TIMEOUT_MS + 500)
  if kind == "timeout" then
    return undecided("no answer within " .. tostring(TIMEOUT_MS + 500) .. " ms")
  end
  if kind ~= "exited" then
    return undecided("probity " .. kind .. " " .. tostring(code) .. ": " .. out)
  end
  local verdict, text, warnings = string.match(out, "^(%a+)\t([^\t\n]*)\t?([^\n]*)")
  if verdict == "allow" then
    if text ~= "" then
      job_desc.admin_comment = "probity:" .. text
      -- Also at the end of the job's comment, which the Prolog's environment carries
      -- (SLURM_JOB_COMMENT): no call to slurmctld at each job start. Any `probity:`
      -- word the user wrote is dropped, and slurm_job_modify refuses their changes.
      local comment = string.gsub(job_desc.comment or "", "%s*probity:%S*", "")
      if comment ~= "" then comment = comment .. " " end
      job_desc.comment = comment .. "probity:" .. text
    end
    -- What warn-mode policies found reaches the submitter, as kubectl shows an
    -- admission's warnings; the job is admitted.
    if warnings ~= nil and warnings ~= "" then
      slurm.log_user("%s", warnings)
    end
    return slurm.SUCCESS
  end
  if verdict == "deny" then
    return refuse(text)
  end
  return undecided("probity exited " .. tostring(code) .. " without a verdict")
end

-- What was judged at submission may not change behind Probity's back: a user's
-- change of any judged field is refused (cancel and submit again); an operator
-- (uid 0 or SlurmUser) may.
local JUDGED = {
  "partition", "account", "qos", "comment", "tres_per_node", "tres_per_job",
  "tres_per_task", "tres_per_socket", "gres", "min_nodes", "num_tasks",
  "cpus_per_task", "min_cpus", "features",
}

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
  if modify_uid == 0 then
    return slurm.SUCCESS
  end
  for _, name in ipairs(JUDGED) do
    if job_desc[name] ~= nil then
      return refuse("Probity: " .. name .. " was judged at submission and cannot be changed: cancel the job and submit it again")
    end
  end
  return slurm.SUCCESS
end

slurm.log_info("probity job_submit.lua loaded: %s, socket %s, %d ms, on error %s", PROBITY, SOCKET, TIMEOUT_MS, ON_ERROR)

return slurm.SUCCESS
