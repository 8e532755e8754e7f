//! Packets in flight: the 16 bytes every hop reads, the header bytes only the receiver reads, and the
//! pool that recycles them so the hot path does not allocate.

/// Largest header the simulator keeps per packet (every control packet and a DATA header fit).
pub const MAX_HDR: usize = 80;

/// What switches and ports read of a packet at every hop, kept apart from its header bytes so the
/// per-hop work touches 16 bytes.
#[derive(Debug, Clone, Copy)]
pub struct PacketMeta {
    /// Source NIC (host · rails + rail).
    pub src_nic: u32,
    /// Destination NIC.
    pub dst_nic: u32,
    /// Bytes on the wire (datagram + link overhead): what serialisation and buffers count.
    pub wire_bytes: u32,
    /// Entropy (UDP source port index) the sender chose.
    pub entropy: u16,
    /// True for DATA packets (OFAN keeps separate pointers for data and acknowledgements).
    pub data: bool,
    /// A switch marked the packet Congestion Experienced. The flag is written into the header's bytes
    /// when the packet is delivered (the header is not read before), so a marking switch touches only
    /// these 16 bytes.
    pub ce: bool,
}

/// The packet's wire bytes up to the payload, exactly as the sending connection wrote them (the
/// payload itself is never read by the protocol in the simulator, so only its length is kept).
#[derive(Clone)]
pub struct PacketBody {
    /// Datagram length handed to the protocol at the receiver.
    pub dgram_len: u32,
    /// Bytes of `hdr` that are valid.
    pub hdr_len: u8,
    /// The datagram's first bytes.
    pub hdr: [u8; MAX_HDR],
}

impl PacketBody {
    /// The valid header bytes.
    #[inline]
    pub fn hdr_bytes(&self) -> &[u8] {
        &self.hdr[..self.hdr_len as usize]
    }
}

/// A packet in flight.
#[derive(Clone)]
pub struct Packet {
    /// What the fabric reads.
    pub meta: PacketMeta,
    /// What the receiver reads.
    pub body: PacketBody,
}

/// A pool of packets, recycled so the hot path does not allocate.
#[derive(Default)]
pub struct PacketPool {
    metas: Vec<PacketMeta>,
    bodies: Vec<PacketBody>,
    free: Vec<u32>,
}

impl PacketPool {
    /// Take a slot and fill it.
    #[inline]
    pub fn alloc(&mut self, p: Packet) -> u32 {
        match self.free.pop() {
            Some(i) => {
                self.metas[i as usize] = p.meta;
                self.bodies[i as usize] = p.body;
                i
            }
            None => {
                self.metas.push(p.meta);
                self.bodies.push(p.body);
                (self.metas.len() - 1) as u32
            }
        }
    }

    /// Return a slot.
    #[inline]
    pub fn release(&mut self, i: u32) {
        self.free.push(i);
    }

    /// The fabric's view of packet `i`.
    #[inline]
    pub fn get(&self, i: u32) -> &PacketMeta {
        &self.metas[i as usize]
    }

    /// The header bytes of packet `i`.
    #[inline]
    pub fn body(&self, i: u32) -> &PacketBody {
        &self.bodies[i as usize]
    }

    /// The fabric's view of packet `i`, mutable (ECN marking).
    #[inline]
    pub fn get_mut(&mut self, i: u32) -> &mut PacketMeta {
        &mut self.metas[i as usize]
    }

    /// Packets alive now (allocated and not released).
    pub fn live(&self) -> usize {
        self.metas.len() - self.free.len()
    }

    /// Slots ever allocated (the high-water mark of packets alive at once).
    pub fn capacity(&self) -> usize {
        self.metas.len()
    }
}
