//! Sets of packets as the reduction sees them: destination port × source address.
//!
//! Why this module exists: a rule set is a program over packets, and "which packets does
//! this chain accept" is a set in two dimensions. Every rule matches a box (a set of ports
//! times a set of source addresses), so the sets the evaluation carries are unions of
//! boxes, kept as disjoint port segments each with its own address set. Segments live in a
//! `BTreeMap` keyed by their first port so that a rule touching a few ports costs a few
//! logarithmic steps, not a scan of the whole set: that keeps 10,000 rules fast.

use std::collections::BTreeMap;

use crate::net::Ranges;

/// A set of (destination port, source address) pairs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Space {
    /// First port of a segment → (last port, source addresses). Segments are disjoint;
    /// their address sets are never empty.
    segs: BTreeMap<u16, (u16, Ranges)>,
}

impl Space {
    pub(crate) fn empty() -> Self {
        Self::default()
    }

    /// Every port, from `addrs`.
    pub(crate) fn full(addrs: &Ranges) -> Self {
        Self::from_box(&Ranges::from_range(0, u128::from(u16::MAX)), addrs)
    }

    /// `ports × addrs`.
    pub(crate) fn from_box(ports: &Ranges, addrs: &Ranges) -> Self {
        let mut s = Self::empty();
        if addrs.is_empty() {
            return s;
        }
        for &(a, b) in ports.intervals() {
            if let (Some(a), Some(b)) = (port(a), port(b)) {
                s.segs.insert(a, (b, addrs.clone()));
            }
        }
        s
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.segs.is_empty()
    }

    /// The segments in port order: (first port, last port, addresses). Adjacent segments
    /// with equal addresses are merged.
    pub(crate) fn segments(&self) -> Vec<(u16, u16, Ranges)> {
        let mut out: Vec<(u16, u16, Ranges)> = Vec::new();
        for (&s, (e, addrs)) in &self.segs {
            match out.last_mut() {
                Some(last) if u32::from(last.1) + 1 == u32::from(s) && last.2 == *addrs => {
                    last.1 = *e;
                }
                _ => out.push((s, *e, addrs.clone())),
            }
        }
        out
    }

    /// The ports present, whatever the addresses.
    pub(crate) fn ports(&self) -> Ranges {
        Ranges::from_unsorted(
            self.segs
                .iter()
                .map(|(&s, (e, _))| (u128::from(s), u128::from(*e)))
                .collect(),
        )
    }

    /// `self ∩ (ports × addrs)`; `addrs` `None` means every address.
    pub(crate) fn intersect_box(&self, ports: &Ranges, addrs: Option<&Ranges>) -> Pieces {
        let mut out = Pieces::default();
        for &(a, b) in ports.intervals() {
            let (Some(a), Some(b)) = (port(a), port(b)) else {
                continue;
            };
            for (s, e, seg_addrs) in self.overlapping(a, b) {
                let meet = match addrs {
                    None => seg_addrs.clone(),
                    Some(x) => seg_addrs.intersect(x),
                };
                if !meet.is_empty() {
                    out.0.push((s.max(a), e.min(b), meet));
                }
            }
        }
        out
    }

    /// Removes `ports × addrs` from `self` and returns what was removed; `addrs` `None`
    /// means every address.
    pub(crate) fn take_box(&mut self, ports: &Ranges, addrs: Option<&Ranges>) -> Pieces {
        let mut out = Pieces::default();
        for &(a, b) in ports.intervals() {
            let (Some(a), Some(b)) = (port(a), port(b)) else {
                continue;
            };
            if addrs.is_none() && self.take_within_one(a, b, &mut out) {
                continue;
            }
            self.split_at(a);
            if let Some(next) = b.checked_add(1) {
                self.split_at(next);
            }
            let keys: Vec<u16> = self.segs.range(a..=b).map(|(&k, _)| k).collect();
            for k in keys {
                match addrs {
                    None => {
                        if let Some((e, r)) = self.segs.remove(&k) {
                            out.0.push((k, e, r));
                        }
                    }
                    Some(x) => {
                        let Some((e, seg_addrs)) = self.segs.get_mut(&k) else {
                            continue;
                        };
                        let meet = seg_addrs.intersect(x);
                        if meet.is_empty() {
                            continue;
                        }
                        out.0.push((k, *e, meet));
                        let rest = seg_addrs.subtract(x);
                        if rest.is_empty() {
                            self.segs.remove(&k);
                        } else {
                            *seg_addrs = rest;
                        }
                    }
                }
            }
        }
        out
    }

    /// The common case of [`Space::take_box`] with every address: `a..=b` lies within one
    /// segment, or in no segment at all. Returns false when neither holds.
    fn take_within_one(&mut self, a: u16, b: u16, out: &mut Pieces) -> bool {
        let (s, e) = match self.segs.range(..=b).next_back() {
            None => return true,
            Some((&s, &(e, _))) => (s, e),
        };
        if e < a {
            // The nearest segment starting at or before b ends before a: nothing here.
            return true;
        }
        if s > a || e < b {
            return false;
        }
        let Some((end, addrs)) = self.segs.get_mut(&s) else {
            return false;
        };
        let taken = addrs.clone();
        if s < a {
            *end = a - 1;
            if e > b {
                self.segs.insert(b + 1, (e, taken.clone()));
            }
        } else {
            self.segs.remove(&s);
            if e > b {
                self.segs.insert(b + 1, (e, taken.clone()));
            }
        }
        out.0.push((a, b, taken));
        true
    }

    /// The segments, consumed, as pieces.
    pub(crate) fn into_pieces(self) -> Pieces {
        Pieces(self.segs.into_iter().map(|(s, (e, r))| (s, e, r)).collect())
    }

    /// `self ∩ other`.
    pub(crate) fn intersect(&self, other: &Space) -> Space {
        let mut out = Space::empty();
        for (&s, (e, addrs)) in &other.segs {
            for (a, b, seg_addrs) in self.overlapping(s, *e) {
                let meet = seg_addrs.intersect(addrs);
                if !meet.is_empty() {
                    out.segs.insert(a.max(s), (b.min(*e), meet));
                }
            }
        }
        out
    }

    /// Removes `ports × addrs` from `self`.
    pub(crate) fn subtract_box(&mut self, ports: &Ranges, addrs: &Ranges) {
        if addrs.is_empty() {
            return;
        }
        for &(a, b) in ports.intervals() {
            let (Some(a), Some(b)) = (port(a), port(b)) else {
                continue;
            };
            self.split_at(a);
            if let Some(next) = b.checked_add(1) {
                self.split_at(next);
            }
            let mut emptied = Vec::new();
            for (&s, (_, seg_addrs)) in self.segs.range_mut(a..=b) {
                *seg_addrs = seg_addrs.subtract(addrs);
                if seg_addrs.is_empty() {
                    emptied.push(s);
                }
            }
            for s in emptied {
                self.segs.remove(&s);
            }
        }
    }

    /// Removes `other` from `self`.
    pub(crate) fn subtract(&mut self, other: &Space) {
        for (&s, (e, addrs)) in &other.segs {
            self.subtract_box(&Ranges::from_range(u128::from(s), u128::from(*e)), addrs);
        }
    }

    /// Adds `other` to `self`.
    pub(crate) fn union_with(&mut self, other: &Space) {
        for (&s, (e, addrs)) in &other.segs {
            self.add_box(s, *e, addrs);
        }
    }

    /// Adds `pieces` to `self`.
    pub(crate) fn add_pieces(&mut self, pieces: Pieces) {
        for (s, e, addrs) in pieces.0 {
            self.add_box(s, e, &addrs);
        }
    }

    fn add_box(&mut self, a: u16, b: u16, addrs: &Ranges) {
        self.split_at(a);
        if let Some(next) = b.checked_add(1) {
            self.split_at(next);
        }
        let existing: Vec<(u16, u16)> =
            self.segs.range(a..=b).map(|(&s, (e, _))| (s, *e)).collect();
        let mut cursor = u32::from(a);
        for (s, e) in existing {
            if u32::from(s) > cursor
                && let (Some(gs), Some(ge)) = (port32(cursor), s.checked_sub(1))
            {
                self.segs.insert(gs, (ge, addrs.clone()));
            }
            if let Some((_, seg_addrs)) = self.segs.get_mut(&s) {
                *seg_addrs = seg_addrs.union(addrs);
            }
            cursor = u32::from(e) + 1;
        }
        if cursor <= u32::from(b)
            && let Some(gs) = port32(cursor)
        {
            self.segs.insert(gs, (b, addrs.clone()));
        }
    }

    /// Makes `p` the first port of a segment if a segment spans it.
    fn split_at(&mut self, p: u16) {
        let Some((&s, &(e, _))) = self.segs.range(..p).next_back() else {
            return;
        };
        if e < p {
            return;
        }
        if let Some((end, addrs)) = self.segs.get_mut(&s) {
            let tail = addrs.clone();
            *end = p.saturating_sub(1);
            self.segs.insert(p, (e, tail));
        }
    }

    /// Segments overlapping `a..=b`, as (first, last, addresses).
    fn overlapping(&self, a: u16, b: u16) -> impl Iterator<Item = (u16, u16, &Ranges)> {
        let before = self
            .segs
            .range(..a)
            .next_back()
            .filter(|(_, (e, _))| *e >= a)
            .map(|(&s, (e, r))| (s, *e, r));
        before
            .into_iter()
            .chain(self.segs.range(a..=b).map(|(&s, (e, r))| (s, *e, r)))
    }
}

/// Boxes of a space under construction, possibly overlapping: the evaluation collects
/// what a chain accepts here and builds the [`Space`] once at the end.
#[derive(Debug, Clone, Default)]
pub(crate) struct Pieces(Vec<(u16, u16, Ranges)>);

impl Pieces {
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub(crate) fn extend(&mut self, other: Pieces) {
        if self.0.is_empty() {
            self.0 = other.0;
        } else {
            self.0.extend(other.0);
        }
    }

    /// The ports touched.
    pub(crate) fn ports(&self) -> Ranges {
        Ranges::from_unsorted(
            self.0
                .iter()
                .map(|(s, e, _)| (u128::from(*s), u128::from(*e)))
                .collect(),
        )
    }

    /// As a space: built in one pass when the pieces are disjoint (the common case: what
    /// definite rules take from a chain's remaining packets never overlaps).
    pub(crate) fn into_space(mut self) -> Space {
        self.0.sort_unstable_by_key(|p| p.0);
        let disjoint = self.0.windows(2).all(|w| matches!(w, [x, y] if x.1 < y.0));
        if disjoint {
            return Space {
                segs: self.0.into_iter().map(|(s, e, r)| (s, (e, r))).collect(),
            };
        }
        // Overlapping pieces (from uncertain rules): sweep over every boundary, taking
        // the union of the pieces that cover each elementary interval.
        let mut bounds: Vec<u32> = Vec::with_capacity(self.0.len() * 2);
        for (s, e, _) in &self.0 {
            bounds.push(u32::from(*s));
            bounds.push(u32::from(*e) + 1);
        }
        bounds.sort_unstable();
        bounds.dedup();
        let mut segs: Vec<(u16, (u16, Ranges))> = Vec::new();
        let mut active: Vec<(u16, Ranges)> = Vec::new();
        let mut next = self.0.into_iter().peekable();
        for w in bounds.windows(2) {
            let [lo, hi] = *w else { continue };
            let (Some(lo), Some(hi)) = (port32(lo), port32(hi - 1)) else {
                continue;
            };
            while let Some((_, e, r)) = next.next_if(|p| p.0 == lo) {
                active.push((e, r));
            }
            active.retain(|(e, _)| *e >= lo);
            let mut it = active.iter();
            let Some((_, first)) = it.next() else {
                continue;
            };
            let addrs = it.fold(first.clone(), |acc, (_, r)| acc.union(r));
            segs.push((lo, (hi, addrs)));
        }
        Space {
            segs: segs.into_iter().collect(),
        }
    }
}

fn port(x: u128) -> Option<u16> {
    u16::try_from(x).ok()
}

fn port32(x: u32) -> Option<u16> {
    u16::try_from(x).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(a: u128, b: u128) -> Ranges {
        Ranges::from_range(a, b)
    }

    #[test]
    fn subtract_then_union_restores() {
        let all = r(0, 100);
        let mut s = Space::full(&all);
        s.subtract_box(&r(22, 22), &all);
        s.subtract_box(&r(1000, 2000), &r(10, 20));
        assert_eq!(s.segments().len(), 4);
        let hit = Space::full(&all).intersect_box(&r(1500, 1500), Some(&r(0, 15)));
        assert_eq!(hit.into_space().segments(), vec![(1500, 1500, r(0, 15))]);
        let mut taken = Space::full(&all);
        let t = taken.take_box(&r(10, 20), Some(&r(0, 50)));
        assert_eq!(t.into_space().segments(), vec![(10, 20, r(0, 50))]);
        assert_eq!(taken.segments()[1], (10, 20, r(51, 100)));
        let t = taken.take_box(&r(0, 5), None);
        assert_eq!(t.into_space().segments(), vec![(0, 5, all.clone())]);
        let mut p = Pieces::default();
        p.extend(Space::from_box(&r(0, 10), &r(1, 1)).into_pieces());
        p.extend(Space::from_box(&r(5, 15), &r(2, 2)).into_pieces());
        assert_eq!(
            p.into_space().segments(),
            vec![(0, 4, r(1, 1)), (5, 10, r(1, 2)), (11, 15, r(2, 2))]
        );
        let mut back = s.clone();
        back.union_with(&Space::from_box(&r(22, 22), &all));
        back.union_with(&Space::from_box(&r(1000, 2000), &r(10, 20)));
        assert_eq!(back.segments(), vec![(0, u16::MAX, all.clone())]);
    }

    #[test]
    fn intersect_and_ports() {
        let a = Space::from_box(&r(10, 30), &r(0, 9));
        let b = Space::from_box(&r(20, 40), &r(5, 50));
        let i = a.intersect(&b);
        assert_eq!(i.segments(), vec![(20, 30, r(5, 9))]);
        assert_eq!(i.ports().intervals(), &[(20, 30)]);
        let mut c = a.clone();
        c.subtract(&b);
        assert_eq!(c.segments(), vec![(10, 19, r(0, 9)), (20, 30, r(0, 4))]);
    }

    #[test]
    fn union_fills_gaps_between_segments() {
        let mut s = Space::from_box(&r(5, 5), &r(1, 1));
        s.union_with(&Space::from_box(&r(9, 9), &r(1, 1)));
        s.union_with(&Space::from_box(&r(0, 20), &r(2, 2)));
        assert_eq!(
            s.segments(),
            vec![
                (0, 4, r(2, 2)),
                (5, 5, r(1, 2)),
                (6, 8, r(2, 2)),
                (9, 9, r(1, 2)),
                (10, 20, r(2, 2))
            ]
        );
    }
}
