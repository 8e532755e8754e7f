//! `-N` local ranks: re-runs this program once per rank with `--rank r --nranks N --rendezvous ADDR`,
//! passes rank 0's stdout through (the table), prefixes every rank's stderr with `[rank r]`, and stops
//! the remaining ranks shortly after one of them fails.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

use crate::bench::ANNOUNCE;

/// How long the other ranks may go on after one failed (time for them to print their own view).
const GRACE: Duration = Duration::from_secs(3);

fn forward_stderr(rank: usize, child: &mut Child) -> Option<JoinHandle<()>> {
    let err = child.stderr.take()?;
    Some(std::thread::spawn(move || {
        for line in BufReader::new(err).lines() {
            let Ok(line) = line else { break };
            let mut e = std::io::stderr().lock();
            let _ = writeln!(e, "[rank {rank}] {line}");
        }
    }))
}

/// The arguments of rank `rank`'s process: the user's, plus where it stands in the job.
pub fn child_args(user_args: &[String], rank: usize, nranks: usize, rendezvous: &str) -> Vec<String> {
    let mut v = user_args.to_vec();
    v.extend([
        "--rank".to_string(),
        rank.to_string(),
        "--nranks".to_string(),
        nranks.to_string(),
        "--rendezvous".to_string(),
        rendezvous.to_string(),
        "--spawned".to_string(),
    ]);
    v
}

/// Flags [`child_args`] appends to the user's.
const CHILD_FLAGS: usize = 7;

/// The command line the user typed, seen from inside a rank (a spawned rank drops what the launcher
/// appended).
pub fn user_command(argv: &[String], spawned: bool) -> Vec<String> {
    let keep = if spawned { argv.len().saturating_sub(CHILD_FLAGS) } else { argv.len() };
    argv[..keep].to_vec()
}

/// Runs `nranks` local ranks of this program and returns the exit code to use.
pub fn spawn_local(nranks: usize, timeout: Duration) -> Result<i32> {
    let exe = std::env::current_exe().context("locating this executable")?;
    let user_args: Vec<String> = std::env::args().skip(1).collect();
    let mut children: Vec<(usize, Child)> = Vec::new();
    let mut threads: Vec<JoinHandle<()>> = Vec::new();

    // Rank 0 picks a free port itself and announces it: no race for the port.
    let mut rank0 = Command::new(&exe)
        .args(child_args(&user_args, 0, nranks, "127.0.0.1:0"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting rank 0")?;
    threads.extend(forward_stderr(0, &mut rank0));
    let out = rank0.stdout.take().ok_or_else(|| anyhow!("rank 0 has no stdout pipe"))?;
    let (addr_tx, addr_rx) = mpsc::channel::<String>();
    threads.push(std::thread::spawn(move || {
        let mut announced = false;
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if !announced {
                if let Some(addr) = line.strip_prefix(ANNOUNCE) {
                    announced = true;
                    let _ = addr_tx.send(addr.trim().to_string());
                    continue;
                }
            }
            let mut o = std::io::stdout().lock();
            let _ = writeln!(o, "{line}");
            let _ = o.flush();
        }
    }));
    children.push((0, rank0));
    let addr = match addr_rx.recv_timeout(timeout) {
        Ok(a) => a,
        Err(_) => {
            for (_, c) in children.iter_mut() {
                let _ = c.kill();
                let _ = c.wait();
            }
            for t in threads {
                let _ = t.join();
            }
            bail!("rank 0 did not announce its rendezvous address (see its messages above)");
        }
    };
    for rank in 1..nranks {
        let mut c = Command::new(&exe)
            .args(child_args(&user_args, rank, nranks, &addr))
            .stdin(Stdio::null())
            .stdout(Stdio::inherit())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting rank {rank}"))?;
        threads.extend(forward_stderr(rank, &mut c));
        children.push((rank, c));
    }

    let mut status: Vec<Option<ExitStatus>> = vec![None; children.len()];
    let mut failed_at: Option<Instant> = None;
    let mut killed = Vec::new();
    while status.iter().any(Option::is_none) {
        for (i, (rank, c)) in children.iter_mut().enumerate() {
            if status[i].is_some() {
                continue;
            }
            if let Some(s) = c.try_wait().with_context(|| format!("waiting for rank {rank}"))? {
                if !s.success() && failed_at.is_none() {
                    failed_at = Some(Instant::now());
                }
                status[i] = Some(s);
            }
        }
        if failed_at.is_some_and(|t| t.elapsed() > GRACE) {
            for (i, (rank, c)) in children.iter_mut().enumerate() {
                if status[i].is_none() {
                    let _ = c.kill();
                    status[i] = c.wait().ok();
                    killed.push(*rank);
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for t in threads {
        let _ = t.join();
    }
    let mut code = 0;
    for ((rank, _), s) in children.iter().zip(&status) {
        let s = s.as_ref().expect("every rank was waited for");
        if killed.contains(rank) {
            eprintln!("prism-perf: rank {rank} stopped after another rank failed");
            code = 1;
        } else if !s.success() {
            eprintln!("prism-perf: rank {rank} exited with {s}");
            code = s.code().unwrap_or(1).max(1);
        }
    }
    Ok(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn children_get_the_users_flags_plus_their_place_in_the_job() {
        let user: Vec<String> = ["all_reduce", "-N", "2", "-b", "1M"].iter().map(|s| s.to_string()).collect();
        let a = child_args(&user, 1, 2, "127.0.0.1:4000");
        assert_eq!(&a[..5], &user[..]);
        assert_eq!(&a[5..], ["--rank", "1", "--nranks", "2", "--rendezvous", "127.0.0.1:4000", "--spawned"]);
        // What a child gets must parse and validate as one rank of a job.
        let parsed = <crate::cli::Args as clap::Parser>::try_parse_from(std::iter::once("prism-perf".to_string()).chain(a)).unwrap();
        parsed.validate().unwrap();
        assert_eq!((parsed.rank, parsed.nranks, parsed.spawned), (Some(1), Some(2), true));
        let argv: Vec<String> = std::iter::once("prism-perf".to_string()).chain(child_args(&user, 1, 2, "h:1")).collect();
        assert_eq!(user_command(&argv, true)[1..], user[..], "the JSON file records what the user typed");
        assert_eq!(argv.len() - 1 - user.len(), CHILD_FLAGS);
    }
}
