//! `ecmp`: one fixed entropy per message, as a NIC that pins a flow to one 5-tuple (the baseline that
//! hash collisions hurt). A retransmission moves to another entropy, and so does the rest of that message.

use rand::{rngs::SmallRng, Rng, SeedableRng};

use super::{other_than, PathCtx, PathPolicy};

/// One entropy per message, drawn at random when the message starts.
#[derive(Debug)]
pub struct Ecmp {
    rng: SmallRng,
    current: Option<(u64, u16)>,
}

impl Ecmp {
    /// An ECMP policy whose per-message entropies are fixed by `seed`.
    pub fn new(seed: u64) -> Self {
        Self { rng: SmallRng::seed_from_u64(seed), current: None }
    }
}

impl PathPolicy for Ecmp {
    fn name(&self) -> &'static str {
        "ecmp"
    }

    fn pick(&mut self, ctx: &PathCtx) -> u16 {
        let n = ctx.n_paths.max(1);
        let e = match self.current {
            Some((msg, e)) if msg == ctx.msg && e < n => e,
            _ => self.rng.gen_range(0..n),
        };
        let e = if ctx.retransmit { other_than(e, ctx.avoid, n) } else { e };
        self.current = Some((ctx.msg, e));
        e
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_entropy_per_message() {
        let mut p = Ecmp::new(3);
        for msg in 0..50 {
            let c = PathCtx { msg, offset: 0, n_paths: 16, retransmit: false, avoid: None, now_us: 0 };
            let first = p.pick(&c);
            for _ in 0..100 {
                assert_eq!(p.pick(&c), first);
            }
        }
    }
}
